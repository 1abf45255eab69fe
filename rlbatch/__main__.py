"""``python -m rlbatch``: the command line (:mod:`rlbatch.commands.main`)."""

from rlbatch.commands.main import main

raise SystemExit(main())
