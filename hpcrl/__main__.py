"""``python -m hpcrl`` is the ``hpcrl`` command."""

import sys

from hpcrl.cli import main

sys.exit(main())
