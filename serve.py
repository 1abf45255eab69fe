"""Entry point of the admission-control sidecar (the ``serve`` command).

    python serve.py --upstream fp16=http://127.0.0.1:8000 [--upstream fp8=URL] \\
        (--policy PATH | --controller playbook|static:N) [--shadow] [--logdir DIR]

Options and behaviour: :mod:`rlbatch.commands.serve` and docs/sidecar.md.
"""

from __future__ import annotations

from rlbatch.commands.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
