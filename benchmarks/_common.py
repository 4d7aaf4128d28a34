"""Shim for the scripts not yet moved into the package (the engine decode benchmark, issue 31).

Remove it when ``bench_decode.py`` imports ``benchmarks.common``.
"""

from common import agg_figure, write_json  # noqa: F401
