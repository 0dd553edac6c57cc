"""`python -m gridwatch.console.cli`: the same entry point as `python -m gridwatch` and `gridwatch`."""

import sys

from gridwatch.console.cli import main

sys.exit(main())
