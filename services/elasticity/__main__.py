"""``python -m phalanx.services.elasticity``: run the elasticity service."""

import sys

from phalanx.services.cli import main

sys.exit(main(["elasticity", *sys.argv[1:]]))
