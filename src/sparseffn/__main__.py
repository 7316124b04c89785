import sys

from sparseffn.cli import main

sys.exit(main())
