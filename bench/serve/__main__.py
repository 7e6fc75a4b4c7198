"""``python -m bench.serve``: runs ``main`` and exits with its status (see the package docstring).

Also how the offline child starts (``python -m bench.serve ... --child-offline c``). It fails
as ``main`` does.
"""

from bench.serve.cli import main

raise SystemExit(main())
