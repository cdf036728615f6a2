"""``python -m phalanx.services.callout``: run the auth callout."""

import sys

from phalanx.services.cli import main

sys.exit(main(["callout", *sys.argv[1:]]))
