"""``python -m phalanx.services.checkpoint``: run the checkpoint service."""

import sys

from phalanx.services.cli import main

sys.exit(main(["checkpoint", *sys.argv[1:]]))
