"""`python -m plait ...` is the `plait` command."""

import sys

from plait.app.cli import main

sys.exit(main())
