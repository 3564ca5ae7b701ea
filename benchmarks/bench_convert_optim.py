"""Bars: a training checkpoint (weights and AdamW state) through convert, reshard and
restore at the speed of cp.

    wall  <= 1.5 x cp -r of the same bytes (the product's bar, optimizer state included),
    RSS   <= the interpreter floor (python -c pass) + 100 MB,

each the median of 5 runs paired with a `cp -r` of the command's input, measured as
``bench_convert`` measures (order alternating, both outputs removed and `sync` run
before each run, outside the timing; inputs read once before any timing).

The input is what torchtitan saves: ``dcp.save({"model": model.state_dict(),
"optimizer": get_optimizer_state_dict(model, opt)})`` of ``bench_convert``'s
Llama-shaped fp32 model (1.24 GiB of weights, pseudo-random) after one real AdamW
step, so ``exp_avg`` and ``exp_avg_sq`` double it: about 3.7 GiB in one ``.distcp``
file, with no ``config.json`` beside it. It is written once under benchmarks/data/
(git-ignored) by torch's own ``dcp.save``. The commands:

    convert SRC -o flat8 -n 8 --sharded      beside cp -r SRC
    reshard flat8 -n 3 --sharded -o flat3    beside cp -r flat8
    restore flat8 -o back --format dcp       beside cp -r flat8

A command that imported torch would pay over a second before its first byte (the
import alone), which no bar of 1.5x cp of a few GiB leaves room for; the CPU time of
each command is printed beside cp's, since on a shared machine the wall time also
measures the queue for a core.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

from .bench_convert import REPEAT, _fresh, _remove, _warm, llama_shapes, paired
from .common import DATA, PYTHON, YAFSDP, MiB, compile_package, median_run, verdict

FOLDER = DATA / "llama-1.2g-adamw.dcp"


def _module(shapes):
    """A module whose parameters have the Llama names and shapes (no forward needed)."""
    import torch

    root = torch.nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    return root


def make_training_dcp(folder: Path) -> None:
    """One real AdamW step on pseudo-random weights and gradients, saved by
    ``dcp.save`` as torchtitan saves (once; later runs reuse the folder)."""
    if (folder / ".metadata").is_file():
        return
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = _module(llama_shapes())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
        state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    tmp.rename(folder)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    compile_package()
    print(f"  load average before: {os.getloadavg()[0]:.2f} (2 cores)")
    make_training_dcp(FOLDER)
    scratch = Path(tempfile.mkdtemp(dir=DATA))
    try:
        return _run_all(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"  load average after: {os.getloadavg()[0]:.2f}")


def _run_all(scratch: Path) -> bool:
    flat8 = scratch / "flat8"
    _fresh([YAFSDP, "convert", str(FOLDER), "-o", str(flat8), "-n", "8", "--sharded"], flat8)
    _warm(FOLDER)
    _warm(flat8)
    floor = median_run([PYTHON, "-c", "pass"], REPEAT)
    files = sorted(p.name for p in FOLDER.iterdir())
    print(
        f"  input {FOLDER.name}: {_size(FOLDER) / 1024**3:.2f} GiB in {', '.join(files)}; "
        f"flat set {_size(flat8) / 1024**3:.2f} GiB in {len(list(flat8.iterdir()))} files"
    )
    print(f"  interpreter floor (python -c pass): {floor.peak_rss_bytes / MiB:.0f} MiB RSS")
    s, f = str(FOLDER), str(flat8)
    cases = [
        ("convert -n 8 --sharded", ["convert", s, "-o", str(scratch / "c8"), "-n", "8",
                                    "--sharded"], FOLDER),
        ("reshard -n 3 --sharded", ["reshard", f, "-n", "3", "--sharded", "-o",
                                    str(scratch / "r3")], flat8),
        ("restore --format dcp", ["restore", f, "-o", str(scratch / "back"), "--format",
                                  "dcp"], flat8),
    ]  # fmt: skip
    ok = True
    for name, argv, cp_src in cases:
        out = Path(argv[argv.index("-o") + 1])
        p = paired(name, [YAFSDP, *argv, "--json"], out, cp_src, scratch)
        spread = ", ".join(f"{r:.2f}" for r in p.ratios)
        print(
            f"  {name}: {p.wall_s:.3f} s beside cp -r {p.cp_s:.3f} s (pairs: {spread}); "
            f"CPU {p.cpu_s:.3f} s beside cp {p.cp_cpu_s:.3f} s ({p.cpu_s / p.cp_cpu_s:.2f}x); "
            f"fastest {p.best_s:.3f} s beside cp {p.cp_best_s:.3f} s "
            f"({p.best_s / p.cp_best_s:.2f}x); {p.peak_rss_bytes / MiB:.0f} MiB RSS"
        )
        ok &= verdict(f"{name} wall / cp", p.wall_s / p.cp_s, 1.5, "x")
        rss_bar = (floor.peak_rss_bytes + 100e6) / MiB
        ok &= verdict(f"{name} peak RSS", p.peak_rss_bytes / MiB, rss_bar, "MiB")
        _remove(out)
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
