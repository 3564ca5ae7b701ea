"""``yafsdp check``: the CI memory-regression gate.

Owns the baseline document (``baseline``), the gate's fake training step
(``step``), the comparison of current figures against a baseline (``check``) and
the command's flow (``run``). It may import the rooms below it (inspect, profiling,
memory, sources, engine, errors); only ``report`` and ``cli`` import it.
"""
