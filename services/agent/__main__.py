"""``python -m phalanx.services.agent``: run one node agent (same as ``phalanx agent``)."""

import sys

from phalanx.services.cli import main

sys.exit(main(["agent", *sys.argv[1:]]))
