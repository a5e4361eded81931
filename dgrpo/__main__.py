"""`python -m dgrpo`: the `dgrpo` command."""

import sys

from dgrpo.cli.main import main

sys.exit(main())
