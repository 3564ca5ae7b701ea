"""``yafsdp check``: the CI memory-regression gate.

Owns the baseline document and the comparison of a new report against it
(``check``): which metrics are gated, their tolerances, the verdict. It may import
the rooms below it (inspect, profiling, memory, sources, engine, errors); only
``report`` and ``cli`` import it.
"""
