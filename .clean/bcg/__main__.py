"""``python -m bcg``: the same command as the ``bcg`` console script."""

from bcg.cli import main

raise SystemExit(main())
