"""``benchmarks/bench_reserved_cuda.py`` without a GPU: it skips cleanly, a failing
case is reported while the rest go on, and its prediction half runs on a tiny model;
and a profiled step's trace replays to the tracker's own peak."""

from __future__ import annotations

import pytest
import torch
from helpers import options, run_gpu_bench_without_gpu

from benchmarks import bench_reserved_cuda as bench
from yafsdp_cli.memory import reserved_of
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the bench would run")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    _, body = run_gpu_bench_without_gpu("bench_reserved_cuda", tmp_path / "reserved.json")
    assert body["skipped"] == "no CUDA device" and body["rows"] == []


def test_a_failing_case_is_reported_and_the_rest_go_on(capsys):
    rows, errors = bench.run_cases(["no-such-case", "nor-this-one"], timeout_s=60)
    assert rows == []
    assert [e["case"] for e in errors] == ["no-such-case", "nor-this-one"]
    assert "no case 'nor-this-one'" in errors[1]["error"]
    assert capsys.readouterr().out.count("FAILED") == 2


def test_cases_past_the_time_allowed_are_skipped_not_run(capsys):
    rows, errors = bench.run_cases(["no-such-case"], total_s=0)
    assert rows == [] and errors == [dict(case="no-such-case", error="skipped: out of time")]
    assert "skipped, out of time" in capsys.readouterr().out


def test_the_cases_are_the_shapes_asked_for():
    names = {c.name for c in bench.CASES}
    assert len(names) == len(bench.CASES)
    assert {c.checkpointing for c in bench.CASES} == {"none", "non-reentrant"}
    assert any(c.param_dtype is None for c in bench.CASES)  # a float32 model
    assert any(c.config == "MixtralConfig" for c in bench.CASES)
    assert bench.QWEN2_05B["tie_word_embeddings"] is True


@pytest.mark.hf
def test_the_prediction_half_runs_on_a_tiny_llama(tmp_path):
    pytest.importorskip("transformers")
    shape = dict(bench.TINYLLAMA, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    case = bench.Case("tiny llama", "LlamaConfig", "LlamaForCausalLM", shape, seq_len=64)
    rows = bench.predict(case, bench.write_folder(case, tmp_path))
    assert set(rows) == {"original", "converted"}
    for row in rows.values():
        # the replay counts whole blocks, so never less than the tracker's bytes
        assert row["predicted_reserved"] >= row["predicted_allocator_allocated"]
        assert row["predicted_allocator_allocated"] >= row["fake_allocated"] > 0
        assert row["trace_events"] > 0


def test_a_profiled_steps_trace_replays_to_the_trackers_peak():
    traces: dict = {}
    report = profile_model(
        load_source(None, model="sample_models.models:gpt"),
        options(ProfileOptions, fake=True, target="cuda", batch=2, seq_len=64),
        traces=traces,
    )
    for step in (report.original, report.converted_step):
        trace = traces[step.variant]
        assert 0 < trace.step_start < len(trace.events)
        est = reserved_of(trace)
        # the trace's requests are the tracker's 512-rounded storages, so their peak
        # is the step's peak; the allocator's blocks and segments only add to it
        assert est.requested_peak == step.peak.total, step.variant
        assert est.reserved_peak >= est.allocated_peak >= est.requested_peak
