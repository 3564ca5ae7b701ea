"""``yafsdp check``: the CI memory-regression gate.

Owns the baseline document (``baseline``), the gate's fake training step as figures
(``step_figures``), the comparison of current figures against a baseline and the
regressions it finds (``regressions``), the command's flow (``run_check``) and the
re-check of a saved plan (``plan_recheck``). It may import the rooms below it
(planning, inspect, profiling, memory, schemes, sources, options, engine, errors); only
``report`` and ``cli`` import it.
"""
