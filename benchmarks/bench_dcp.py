"""DCP interop: `yafsdp convert` from a ~1.2 GiB DCP folder and `restore --format dcp`.

    wall   <= 2.0 x (cp of the same bytes + python -c "import torch, torch.distributed.checkpoint")
    RSS    <= RSS of that import + 2 x the largest tensor + 256 MiB

The floor imports torch.distributed.checkpoint as well as torch: what reading and
writing DCP with torch's own reader and writer would pay (about 1 s over torch alone
on 2 cores). yafsdp's reader and writer import neither (docs/dcp.md), so this bar is
loose; ``bench_convert_optim`` holds DCP, optimizer state included, to the product's
1.5x ``cp``.

The input is ``bench_convert``'s Llama-shaped fp32 checkpoint (1.24 GiB, largest
tensor 250 MiB) saved once by torch's own ``dcp.save`` under benchmarks/data/
(git-ignored). A tensor that only torch's reader reads is held whole, twice, while
it is copied; the RSS bar allows that and nothing that grows with the model. Runs are
paired: each round runs the import floor, ``cp`` of the data file, convert, then
restore, outputs deleted and ``sync`` run before each (outside the timing); medians of
3 rounds after a warm-up.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import warnings
from pathlib import Path

from .bench_convert import HIDDEN, VOCAB, make_checkpoint
from .common import DATA, PYTHON, YAFSDP, MiB, measure, verdict

REPEAT = 3


def make_dcp(src: Path, folder: Path) -> None:
    """The safetensors checkpoint as a one-rank DCP folder (once)."""
    if (folder / ".metadata").is_file():
        return
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(load_file(str(src)), checkpoint_id=str(tmp), no_dist=True)
    tmp.rename(folder)


def _clean(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    import os

    os.sync()


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    src = DATA / "llama-1.2g-fp32.safetensors"
    make_checkpoint(src)
    folder = DATA / "llama-1.2g-fp32.dcp"
    make_dcp(src, folder)
    data_file = folder / "__0_0.distcp"
    size = data_file.stat().st_size
    work = Path(tempfile.mkdtemp(dir=DATA))
    copy, flat, back = work / "copy.distcp", work / "flat.safetensors", work / "back"
    floor_argv = [PYTHON, "-W", "ignore", "-c", "import torch, torch.distributed.checkpoint"]
    commands = {  # name: (argv, its output)
        "floor": (floor_argv, copy),
        "cp": (["cp", str(data_file), str(copy)], copy),
        "convert": ([YAFSDP, "convert", str(folder), "-o", str(flat), "-n", "8"], flat),
        "restore": ([YAFSDP, "restore", str(flat), "-o", str(back), "--format", "dcp"], back),
    }
    runs: dict[str, list] = {k: [] for k in commands}
    for _ in range(REPEAT + 1):  # paired rounds: the floor beside each measured command
        for name, (argv, output) in commands.items():
            _clean(output)
            run = measure(argv)
            if run.returncode != 0:
                raise SystemExit(f"{name} failed with exit code {run.returncode}")
            runs[name].append(run)
    _clean(work)
    med = {k: statistics.median(r.wall_s for r in v[1:]) for k, v in runs.items()}
    rss = {k: statistics.median(r.peak_rss_bytes for r in v[1:]) for k, v in runs.items()}
    print(f"  input {folder.name}: {size / 1024**3:.2f} GiB in one .distcp file")
    print(
        f"  floors: cp {med['cp']:.3f} s, import torch + DCP {med['floor']:.3f} s / "
        f"{rss['floor'] / MiB:.0f} MiB RSS"
    )
    for name in ("convert", "restore"):
        print(f"  {name}: {med[name]:.3f} s, {rss[name] / MiB:.0f} MiB RSS")
    largest = VOCAB * HIDDEN * 4
    wall_bar = 2.0 * (med["cp"] + med["floor"])
    rss_bar = (rss["floor"] + 2 * largest + 256 * MiB) / MiB
    ok = True
    for name in ("convert", "restore"):
        ok = verdict(f"{name} wall", med[name], wall_bar, "s") and ok
        ok = verdict(f"{name} peak RSS", rss[name] / MiB, rss_bar, "MiB") and ok
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
