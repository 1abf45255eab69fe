"""``python -m rlbatch.profiles {check,fit} ...``: stand-alone entry points of the profile tools.

``check`` is :func:`rlbatch.profiles.check.profile_check_main` (the project CLI's
``profile-check``); ``fit`` is :func:`rlbatch.profiles.fit.main`.
"""

from __future__ import annotations

import sys

from rlbatch.profiles import check, fit


def main(argv: list[str] | None = None) -> int:
    """Dispatch to ``check`` or ``fit``.

    :param argv: arguments (default ``sys.argv[1:]``), the first naming the tool.
    :returns: process exit status.
    """
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("check", "fit"):
        print("usage: python -m rlbatch.profiles {check,fit} ... (see --help of each)",
              file=sys.stderr)
        return 2
    if args[0] == "check":
        return check.profile_check_main(args[1:])
    return fit.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
