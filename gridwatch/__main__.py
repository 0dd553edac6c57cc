"""`python -m gridwatch`: the same entry point as `gridwatch`."""

import sys

from gridwatch.console.cli import main

sys.exit(main())
