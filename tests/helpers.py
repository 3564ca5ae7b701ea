"""Shared test helpers: seeded models and a reference training loop."""

from __future__ import annotations

import copy

import torch
from torch import nn

from sample_models.models import FACTORIES
from yafsdp_cli import convert_module, plan, spec_from_module
from yafsdp_cli.engine.inputs import make_input, projection_loss
from yafsdp_cli.options import LayoutOptions


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FACTORIES[name]()


def original_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def original_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def run_steps(model, flat=None, *, steps=3, micro=2, optimizer="adamw", seed=0, on="flat"):
    """Train ``steps`` steps of ``micro`` accumulated micro-batches; record everything.

    Returns one dict per step: outputs, grads by name (tied names too) and the
    parameters after the optimizer step, all cloned. A converted model's optimizer
    steps on its flat buffers (``on="flat"``, the metaparam way) or on the module's
    own parameters (``on="params"``, what unmodified training code does).
    """
    params = flat.parameters() if flat is not None and on == "flat" else model.parameters()
    opt = make_optimizer(optimizer, params)
    record = []
    for step in range(steps):
        outputs = []
        for m in range(micro):
            x = make_input(model, seed=seed + 100 * step + m)
            out = model(x)
            projection_loss(out, seed=seed + step).backward()
            outputs.append(out.detach().clone())
        grads = flat.named_grads() if flat else original_grads(model)
        grads = {n: None if g is None else g.clone() for n, g in grads.items()}
        if opt is not None:
            opt.step()
        params = flat.named_params() if flat else original_params(model)
        record.append(
            {
                "outputs": outputs,
                "grads": grads,
                "params": {n: p.clone() for n, p in params.items()},
            }
        )
        (opt.zero_grad() if opt is not None else model.zero_grad())
    return record


def make_optimizer(kind, params):
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, foreach=False)
    return None


def convert_copy(model: nn.Module, **plan_kwargs):
    """A converted deep copy of ``model`` and its FlatModel handle."""
    twin = copy.deepcopy(model)
    flat = convert_module(twin, plan(spec_from_module(twin), LayoutOptions(**plan_kwargs)))
    return twin, flat


def assert_records_equal(a, b) -> None:
    """Bit-exact equality of two run_steps records (NaN-free inputs)."""
    assert len(a) == len(b)
    for step, (ra, rb) in enumerate(zip(a, b)):
        for i, (oa, ob) in enumerate(zip(ra["outputs"], rb["outputs"])):
            assert torch.equal(oa, ob), f"step {step} micro-batch {i}: outputs differ"
        for kind in ("grads", "params"):
            assert ra[kind].keys() == rb[kind].keys(), kind
            for name, ta in ra[kind].items():
                tb = rb[kind][name]
                assert (ta is None) == (tb is None), f"step {step} {kind} {name}: None mismatch"
                if ta is not None:
                    assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{kind} {name}"
                    diff = (ta.double() - tb.double()).abs().max().item() if ta.numel() else 0
                    assert torch.equal(ta, tb), f"step {step} {kind} {name}: max diff {diff}"


def run_gpu_bench_without_gpu(module: str, out) -> tuple[str, dict]:
    """``python -m benchmarks.MODULE --out OUT`` on a machine without CUDA: it must say
    so and exit 0; its stdout and the JSON it wrote."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    return done.stdout, json.loads(Path(out).read_text())


def options(cls, **given):
    """``cls`` (a command's options) with ``given`` by field name: the command's own
    fields as they are, a piece's fields into that piece of ``cls()``'s defaults (read
    from the pieces' dataclass fields; the command's own field of a name wins). A
    shorthand for tests: the library and the command line build the pieces whole."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(cls)}
    pieces = [n for n in ("layout", "step", "memory") if n in own]
    if cls.__name__ == "PlanOptions":  # it needs a GPU's memory to be made at all
        from yafsdp_cli.planning.plan_options import PLAN_MEMORY, PLAN_STEP

        bases = {"layout": None, "step": PLAN_STEP, "memory": PLAN_MEMORY}
    else:
        bases = {n: getattr(cls(), n) for n in pieces}
    out = {k: v for k, v in given.items() if k in own}
    for name in pieces:
        base = out.get(name) or bases[name]
        if base is None:
            base = LayoutOptions()
        names = {f.name for f in dataclasses.fields(base)} - own
        mine = {k: v for k, v in given.items() if k in names}
        out[name] = dataclasses.replace(base, **mine)
    unknown = set(given) - own - {f.name for n in pieces for f in dataclasses.fields(out[n])}
    if unknown:
        raise TypeError(f"{cls.__name__} has no option {', '.join(sorted(unknown))}")
    return cls(**out)


def plan_against_real_steps(
    loaded, *, checkpointing, world_sizes=(1, 2, 4, 8), target="cpu", seq_len=16
) -> dict[tuple[int, int, str], int]:
    """Plan ``loaded`` at ``world_sizes`` x micro-batches 1, 2 x ``checkpointing`` and
    check the converted step at (1, 1) and (4, 2) against it, to the byte: real for
    the CPU's kernels, ``profile --fake --target cuda``'s for CUDA's (world size 4 is
    the events of the step at 2, resized). Returns the measured peaks by (world size,
    micro-batch, checkpointing)."""
    from yafsdp_cli.planning import PlanOptions, plan_model
    from yafsdp_cli.profiling import ProfileOptions
    from yafsdp_cli.profiling.profiler import profile_converted

    opts = options(
        PlanOptions,
        gpu_memory=2**40,
        reserve=0,
        world_sizes=world_sizes,
        micro_batches=(1, 2),
        seq_len=seq_len,
        target=target,
        checkpointing=tuple(checkpointing),
    )
    report = plan_model(loaded, opts)
    rows = {(r.world_size, r.micro_batch, r.checkpointing): r for r in report.rows}
    measured = {}
    for (ws, mb), ck in [((w, m), c) for w, m in ((1, 1), (4, 2)) for c in report.checkpointing]:
        real = profile_converted(
            loaded,
            options(
                ProfileOptions,
                world_size=ws,
                batch=mb,
                seq_len=seq_len,
                fake=target == "cuda",
                target=target,
                param_dtype=opts.step.param_dtype,
                checkpointing=ck,
                round_bytes=opts.memory.round_bytes,
                optimizer_impl=opts.step.optimizer_impl,
            ),
        ).peak.total
        planned = rows[(ws, mb, ck)].peak_bytes
        assert planned == real, (ws, mb, ck, planned, real)
        measured[(ws, mb, ck)] = real
    return measured
