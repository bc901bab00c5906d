"""``python -m hpcrl`` is the ``hpcrl`` command."""

from hpcrl.cli import console_main

console_main()
