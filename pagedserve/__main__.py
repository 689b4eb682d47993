import sys

from pagedserve.cli import main

sys.exit(main())
