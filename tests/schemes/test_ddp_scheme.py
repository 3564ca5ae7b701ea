"""DDP: everything whole, its buckets beside, one all-reduce per unit."""

from __future__ import annotations

from scheme_cases import AT_ONE, TODAY, figures

from yafsdp_cli.memory.step_schemes import SchemeSettings
from yafsdp_cli.schemes import DDP, WHOLE, Holds


def test_a_rank_holds_everything_whole():
    assert DDP.holds == Holds(params=WHOLE, grads=WHOLE, optimizer=WHOLE)
    assert DDP.whole_params


def test_memory_and_peaks_per_phase_are_todays():
    assert figures(DDP) == TODAY[("ddp", True)]
    assert figures(DDP, ws=1) == AT_ONE


def test_collectives_all_reduce_gradients_and_gather_nothing():
    c = DDP.collectives
    assert (c.gathers_params, c.reduces, c.sized_by) == (False, "all_reduce", "unit_grads")


def test_its_configuration_names_the_bucket_settings():
    assert DDP.configuration(SchemeSettings()) == (
        "bucket_cap_mb=25, gradient_as_bucket_view=False"
    )


def test_names_on_the_command_line_and_in_the_documents():
    assert (DDP.name, DDP.inspect_key, DDP.timing_key) == ("ddp", "ddp", "ddp")
