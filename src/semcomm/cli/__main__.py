"""``python -m semcomm.cli``: the same as the ``semcomm`` command."""

from . import main

main()
