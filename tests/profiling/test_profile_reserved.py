"""`profile --target cuda`: the predicted reserved peak, the memory outside the
allocator and their sum, the same in every format; CUDA peaks from a clean
allocator; nothing of a profile (or a plan) outlives the call."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.memory import reserved_of
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.profiling import profiler as profiler_module
from yafsdp_cli.report.formatting import human_bytes
from yafsdp_cli.report.html_pages import profile_page
from yafsdp_cli.report.profile_view import to_json, to_markdown
from yafsdp_cli.sources import load_source

runner = CliRunner()
MODEL = "sample_models.models:llama"
CUDA = dict(fake=True, target="cuda", world_size=2)


@pytest.fixture(scope="module")
def report():
    return profile_model(load_source(None, model=MODEL), options(ProfileOptions, **CUDA))


def test_reserved_is_the_replay_of_the_step_trace(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    traces: dict = {}
    r = profile_model(
        load_source(None, model=MODEL), options(ProfileOptions, **CUDA), traces=traces
    )
    for step in (r.original, r.converted_step):
        est = reserved_of(traces[step.variant])
        assert step.reserved.reserved_peak == est.reserved_peak > 0
        assert step.reserved.fragmentation == est.fragmentation
        assert step.reserved.outside_bytes == r.outside.total > 0
        assert step.reserved.gpu_bytes == est.reserved_peak + r.outside.total
        assert step.reserved.alloc_conf == "default"


def test_alloc_conf_option_and_variable(monkeypatch):
    opts = options(ProfileOptions, **CUDA, alloc_conf="expandable_segments:True")
    r = profile_model(load_source(None, model=MODEL), opts)
    assert r.converted_step.reserved.alloc_conf == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    r = profile_model(load_source(None, model=MODEL), options(ProfileOptions, **CUDA))
    assert r.original.reserved.alloc_conf == "expandable_segments:True"


def test_cpu_figures_have_no_reserved():
    r = profile_model(load_source(None, model=MODEL), options(ProfileOptions, fake=True))
    assert r.original.reserved is None and r.outside is None
    assert json.loads(to_json(r))["outside"] is None


def test_a_bad_alloc_conf_is_one_line_before_the_step(monkeypatch):
    result = runner.invoke(
        app, ["profile", "--model", MODEL, "--fake", "--target", "cuda", "--alloc-conf", "x:1"]
    )
    assert result.exit_code == 2, result.output
    assert "x" in result.output and len(result.output.strip().splitlines()) == 1
    monkeypatch.setenv("NCCL_BUFFSIZE", "lots")
    result = runner.invoke(app, ["profile", "--model", MODEL, "--fake", "--target", "cuda"])
    assert result.exit_code == 2 and "NCCL_BUFFSIZE='lots'" in result.output


def test_the_same_numbers_in_json_markdown_html_and_the_table(report):
    doc = json.loads(to_json(report))
    md, html = to_markdown(report), profile_page(report)
    result = runner.invoke(
        app, ["profile", "--model", MODEL, "--fake", "--target", "cuda", "--world-size", "2"]
    )
    assert result.exit_code == 0, result.output
    assert doc["outside"]["total_bytes"] == report.outside.total
    assert [p["name"] for p in doc["outside"]["parts"]] == [p.name for p in report.outside.parts]
    for key in ("original", "converted"):
        step = report.original if key == "original" else report.converted_step
        assert doc[key]["reserved"]["gpu_bytes"] == step.reserved.gpu_bytes
        for n in (step.reserved.reserved_peak, step.reserved.gpu_bytes):
            assert human_bytes(n) in md and human_bytes(n) in html
    for text in (md, html, result.output):
        assert "GPU must hold" in text and "Outside the caching allocator" in text
        assert human_bytes(report.outside.total) in text


def test_cuda_peaks_start_from_a_clean_allocator_between_the_steps(monkeypatch):
    """With the GPU calls stubbed: the cache is emptied and the peaks reset after the
    original's step and before the converted step's, and the peaks read after each."""
    calls: list[str] = []
    monkeypatch.setattr(profiler_module, "_on_cuda", lambda device: True)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda n=name: calls.append(n))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: calls.append("peak") or 1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 2)
    real_step = profiler_module._tracked_step

    def step(tracker, *args):
        calls.append("step")
        return real_step(tracker, *args)

    monkeypatch.setattr(profiler_module, "_tracked_step", step)
    r = profile_model(load_source(None, model=MODEL), options(ProfileOptions, fake=True))
    marks = [c for c in calls if c != "synchronize"]
    clean = ["empty_cache", "reset_peak_memory_stats"]
    assert marks == [*clean, "step", "peak", *clean, "step", "peak"]
    assert r.original.cuda.reserved_peak == r.converted_step.cuda.reserved_peak == 2


def test_cpu_runs_touch_no_cuda_call(monkeypatch):
    def boom(*_a):
        raise AssertionError("a CUDA call on the CPU")

    for name in ("empty_cache", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, boom)
    r = profile_model(load_source(None, model=MODEL), options(ProfileOptions, fake=True))
    assert r.original.cuda is None


class Made:
    """Weak references to every module and tensor the model factory makes (the
    module, its parameters and buffers) and to every tensor made under the call."""

    def __init__(self):
        self.refs: list[weakref.ref] = []

    def watch(self, loaded):
        build = loaded.build_module

        def tracked_build(*args, **kwargs):
            module = build(*args, **kwargs)
            self.refs.append(weakref.ref(module))
            self.refs.extend(weakref.ref(t) for t in (*module.parameters(), *module.buffers()))
            return module

        loaded.build_module = tracked_build
        return loaded

    def alive(self) -> list:
        gc.collect()
        return [type(o).__name__ for r in self.refs if (o := r()) is not None]


def tensors_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), (torch.Tensor, torch.nn.Module)))


@pytest.mark.parametrize(
    "opts",
    [
        dict(world_size=2, per_module=True, modules=3),
        dict(world_size=1, checkpointing="non-reentrant"),
        dict(**CUDA, per_module=True),
    ],
    ids=["real-sharded-per-module", "real-checkpointed", "fake-cuda"],
)
def test_nothing_of_a_profile_outlives_it(opts):
    made = Made()
    loaded = made.watch(load_source(None, model=MODEL))
    profile_model(loaded, options(ProfileOptions, **opts))  # first call: caches torch fills once
    base = tensors_alive()
    for _ in range(3):
        profile_model(loaded, options(ProfileOptions, **opts))
    assert tensors_alive() == base
    if not opts.get("fake"):
        assert made.refs and made.alive() == []


def test_nothing_of_a_plan_outlives_it():
    from yafsdp_cli.planning import PlanOptions, plan_model

    loaded = load_source(None, model="sample_models.models:gpt")
    opts = options(
        PlanOptions,
        gpu_memory=2**30,
        reserve=0,
        seq_len=16,
        world_sizes=(1,),
        micro_batches=(1, 2),
        jobs=1,
    )
    plan_model(loaded, opts)
    base = tensors_alive()
    for _ in range(2):
        plan_model(loaded, opts)
    assert tensors_alive() == base
