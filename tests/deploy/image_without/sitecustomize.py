"""Import blocker: a stand-in process lacks what its container's image lacks.

``deploy_local.World`` puts this directory first on ``PYTHONPATH`` of a process standing
in for a container whose image holds less than this virtualenv (the control-plane
image: no torch, numpy, matplotlib, pynvml), and names the top-level modules that image
does not hold in ``DEPLOY_LOCAL_ABSENT_MODULES``. Importing one of them, or anything
under it, then fails with ``ModuleNotFoundError`` as it would in the image, so a service
that comes to need one fails the deploy tests instead of the first real deployment.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder

ABSENT = frozenset(filter(None, os.environ.get("DEPLOY_LOCAL_ABSENT_MODULES", "").split(",")))


class NotInImage(MetaPathFinder):
    """Refuses the absent modules before any other finder can find them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in this container's "
                                      "image: deploy/requirements.py)", name=fullname)
        return None


if ABSENT:
    sys.meta_path.insert(0, NotInImage())
