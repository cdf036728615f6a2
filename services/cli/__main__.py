"""``python -m phalanx.services.cli``: the ``phalanx`` command (how ``phalanx up --detach``
starts its cluster, and how tests run the command without the installed script)."""

import sys

from phalanx.services.cli import main

sys.exit(main())
