"""``python -m rlbatch.tools.sweep``: the sweep on its own (same arguments as ``rlbatch sweep``)."""

from rlbatch.tools.sweep.cli import main

raise SystemExit(main())
