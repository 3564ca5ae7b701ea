"""ZeRO stages 1-3: what each partitions, their per-phase peaks, and that the
step-time model has no collectives for them."""

from __future__ import annotations

import pytest
from scheme_cases import AT_ONE, TODAY, figures

from yafsdp_cli.memory.step_schemes import SchemeSettings
from yafsdp_cli.schemes import SHARDED, WHOLE, ZERO1, ZERO2, ZERO3, Holds


def test_each_stage_partitions_one_part_more():
    assert ZERO1.holds == Holds(params=WHOLE, grads=WHOLE, optimizer=SHARDED)
    assert ZERO2.holds == Holds(params=WHOLE, grads=SHARDED, optimizer=SHARDED)
    assert ZERO3.holds == Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED)
    assert [s.whole_params for s in (ZERO1, ZERO2, ZERO3)] == [True, True, False]


@pytest.mark.parametrize("scheme", [ZERO1, ZERO2, ZERO3], ids=lambda s: s.name)
def test_memory_and_peaks_per_phase_are_todays(scheme):
    assert figures(scheme) == TODAY[(scheme.name, True)]
    assert figures(scheme, reshard=False) == TODAY[(scheme.name, True)]
    assert figures(scheme, ws=1) == AT_ONE


def test_no_collectives_model_and_no_timing_key():
    for s in (ZERO1, ZERO2, ZERO3):
        assert s.collectives is None and s.timing_key is None
    assert (ZERO1.inspect_key, ZERO2.inspect_key, ZERO3.inspect_key) == (None, "zero2", "zero3")


def test_configurations_in_deepspeeds_terms():
    settings = SchemeSettings()
    assert (
        ZERO1.configuration(settings)
        == ZERO2.configuration(settings)
        == ("reduce_bucket_size=5e8, contiguous_gradients")
    )
    assert ZERO3.configuration(settings) == (
        "prefetch 5e7, max live 1e9, reuse distance 1e9, persistence 1e5, reduce_bucket_size=5e8"
    )
