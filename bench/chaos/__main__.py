"""``python -m bench.chaos``: runs ``bench.chaos.cli.main`` (flags in ``--help``).

How it fails: as ``main`` does; its return value is the exit status.
"""

from bench.chaos.cli import main

raise SystemExit(main())
