"""``python -m rlbatch.sweep``: the sweep on its own (same arguments as ``rlbatch sweep``)."""

from rlbatch.sweep.cli import main

raise SystemExit(main())
