"""``python -m phalanx.services.admission``: run one admission instance (``phalanx admission``)."""

import sys

from phalanx.services.cli import main

sys.exit(main(["admission", *sys.argv[1:]]))
