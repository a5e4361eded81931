import sys

from dgrpo.cli.main import main

sys.exit(main())
