"""``python -m tests.warm_starts``: build, check or list the shipped warm starts (see the package doc)."""

import sys

from tests.warm_starts import main

sys.exit(main())
