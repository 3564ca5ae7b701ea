"""The flat scheme: sharded everything, its memory the memory model's flat column,
its collectives one per flat buffer."""

from __future__ import annotations

from scheme_cases import AT_ONE, TODAY, figures, spec

from yafsdp_cli import LayoutOptions, plan
from yafsdp_cli.memory import MemoryConfig, estimate_memory
from yafsdp_cli.schemes import FLAT, SHARDED, Holds


def test_a_rank_holds_shards_of_everything():
    assert FLAT.holds == Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED)
    assert not FLAT.whole_params


def test_memory_and_peaks_per_phase_are_todays():
    assert figures(FLAT) == TODAY[("flat", True)]
    assert figures(FLAT, reshard=False) == TODAY[("flat", True)]  # FSDP2's knob only
    assert figures(FLAT, ws=1) == AT_ONE


def test_its_memory_is_the_memory_models_flat_column():
    layout = plan(spec(), LayoutOptions(world_size=4, units=("layers.*",)))
    report = estimate_memory(layout, MemoryConfig(round_bytes=1))
    assert report.flat.scheme is FLAT
    assert figures(FLAT)[0] == (
        report.flat.params, report.flat.grads, report.flat.optimizer, report.flat.master,
        report.flat.buffers, report.flat.gather, report.flat.reduce,
    )  # fmt: skip


def test_collectives_gather_parameters_and_reduce_scatter_buffers():
    c = FLAT.collectives
    assert (c.gathers_params, c.reduces, c.sized_by) == (True, "reduce_scatter", "buffers")


def test_names_on_the_command_line_and_in_the_documents():
    assert (FLAT.name, FLAT.inspect_key, FLAT.timing_key) == ("flat", "yafsdp", "yafsdp")
