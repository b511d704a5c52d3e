"""`python -m pdgate.cli`: the same as the `pdgate` command."""

import sys

from pdgate.cli.main import main

sys.exit(main())
