"""``python -m rlbatch``: see ``rlbatch.cli``."""

from rlbatch.cli import main

raise SystemExit(main())
