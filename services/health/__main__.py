"""``python -m phalanx.services.health``: run the health service (``phalanx health``)."""

import sys

from phalanx.services.cli import main

sys.exit(main(["health", *sys.argv[1:]]))
