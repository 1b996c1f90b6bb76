import sys

from butter.cli.main import main

sys.exit(main())
