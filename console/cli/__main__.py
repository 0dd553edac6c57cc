"""`python -m console.cli`: the same entry point as `python -m console` and `gridwatch`."""

import sys

from console.cli import main

sys.exit(main())
