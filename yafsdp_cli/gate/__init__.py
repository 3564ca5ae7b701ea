"""``yafsdp check``: the CI memory-regression gate.

Owns the baseline document (``baseline``), the gate's fake training step as figures
(``step_figures``), the comparison of current figures against a baseline and the
regressions it finds (``regressions``) and the command's flow (``run_check``). It may
import the rooms below it (inspect, profiling, memory, sources, engine, errors); only
``report`` and ``cli`` import it.
"""
