"""The product's performance bars, each measured beside its floor (``make bench``).

Each ``bench_*.py`` states its bar in its docstring: wall time and peak RSS as a
multiple of (or an allowance over) a floor measured in the same run, such as
``python -c "import torch"`` or ``cp`` of the same file. ``python -m benchmarks.run``
runs them and writes ``benchmarks/RESULTS.md``.
"""
