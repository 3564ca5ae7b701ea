"""FSDP2: sharded everything, FSDP2's fullest rank, one collective per unit."""

from __future__ import annotations

from scheme_cases import AT_ONE_FSDP2, TODAY, figures

from yafsdp_cli.memory.step_schemes import SchemeSettings
from yafsdp_cli.schemes import FSDP2, SHARDED, Holds


def test_a_rank_holds_shards_of_everything():
    assert FSDP2.holds == Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED)
    assert not FSDP2.whole_params


def test_memory_and_peaks_per_phase_are_todays():
    assert figures(FSDP2) == TODAY[("fsdp2", True)]
    assert figures(FSDP2, reshard=False) == TODAY[("fsdp2", False)]
    assert figures(FSDP2, ws=1) == figures(FSDP2, ws=1, reshard=False) == AT_ONE_FSDP2


def test_kept_gathered_peaks_by_phase():
    (params, grads, opt, master, bufs, gather, reduce), peaks = TODAY[("fsdp2", False)]
    total = params + grads + opt + master + bufs + gather + reduce
    own = 100 - 10 + 30
    assert peaks == (total - grads - reduce + own, total - grads + own,
                     total - gather - reduce + own)  # fmt: skip


def test_collectives_gather_units_and_reduce_scatter_them():
    c = FSDP2.collectives
    assert (c.gathers_params, c.reduces, c.sized_by) == (True, "reduce_scatter", "placement")


def test_its_configuration_names_the_knob():
    assert FSDP2.configuration(SchemeSettings()) == "reshard_after_forward=True"


def test_names_on_the_command_line_and_in_the_documents():
    assert (FSDP2.name, FSDP2.inspect_key, FSDP2.timing_key) == ("fsdp2", "fsdp", "fsdp2")
