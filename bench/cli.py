"""``prefixserve bench ...``: the benchmark subcommands hooked into ``cluster.cli``.

Today: ``prefixserve bench serve`` (the load generator in ``bench/loadgen``).
"""

from bench.loadgen.cli import add_parser

__all__ = ["add_parser"]
