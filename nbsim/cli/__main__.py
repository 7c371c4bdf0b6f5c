"""`python -m nbsim.cli`: the `nbsim` command in this process (no worker)."""

import sys

from . import main

sys.exit(main())
