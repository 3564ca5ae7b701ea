"""Bars: `convert`, `restore` and `reshard` at the speed of `cp`.

    wall  <= 1.5 x cp of the same file (the product's bar: the command pays Python's
             start-up and a CRC read-back of every byte, which cp does not),
    RSS   <= the interpreter floor (python -c pass) + 100 MB,

each the median of 5 runs, every run paired with a `cp` of its input right before or
after it (the order alternates), so both see the same load. Both outputs of a pair
are removed before each run: on a virtual machine with free page reporting a write
into the page cache is fast when it can reuse the pages of a file just deleted and
slow when the pages must come back from the host, so removing only a command's own
output would hand each command its own previous output's pages, whatever the other
did (docs/checkpoints.md, "Copying at the speed of cp"). The input is a
Llama-shaped fp32 checkpoint (4 decoder layers, hidden 2048, intermediate 5504,
vocabulary 32000, untied head: 1.24 GiB) written once under benchmarks/data/
(git-ignored) with pseudo-random bytes; restore and reshard read the flat file that
`convert --world-size 8` makes of it. Page cache: every input is read once before
any timing, so cp and yafsdp both read it warm; each output is deleted and `sync`
run before each run (outside the timing), so no writeback of an earlier run competes
(neither fsyncs). Also printed, without a bar: the startup floor (`yafsdp convert`
of a 12 KiB file), since every command pays it and `cp` does not, and the CPU time
(user + system, from wait4) of each command beside cp's: on a machine shared with
other jobs the wall time mostly measures the queue for a core, the CPU time the work.

Then the sparse case: `convert` of the 70B-shaped file of bench_inspect_70b (a real
723-tensor header and a ~138 GB hole) to a flat file that must stay sparse, beside
`cp --sparse=always` of the same file. It runs only where the file system keeps
holes (checked first with a small file, so that a 138 GB copy can never fill the disk).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .common import (
    DATA,
    PYTHON,
    ROOT,
    YAFSDP,
    MiB,
    Run,
    compile_package,
    measure,
    median_run,
    verdict,
)

LAYERS, HIDDEN, INTER, VOCAB = 4, 2048, 5504, 32000
REPEAT = 5


def llama_shapes(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.v_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    return shapes + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def make_checkpoint(path: Path, layers: int = LAYERS) -> None:
    """A plain safetensors file (header by hand: this must not depend on yafsdp)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in llama_shapes(layers):
        n = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    expected = 8 + len(raw) + offset
    if path.is_file() and path.stat().st_size == expected:
        return
    block = os.urandom(16 * MiB)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _fresh(argv: list[str], out: Path, *others: Path) -> Run:
    """Run ``argv`` after removing its output and every other output of the pair
    (``others``), so that both commands of a pair start from the same page cache."""
    for path in (out, *others):
        _remove(path)
    os.sync()  # no writeback of an earlier run's output competes with this one
    run = measure(argv)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:2])} failed with exit code {run.returncode}")
    return run


@dataclass(frozen=True)
class Paired:
    name: str
    wall_s: float  # median
    cp_s: float  # median of the paired cp runs
    ratios: tuple[float, ...]  # per pair
    peak_rss_bytes: int  # median
    stdout: bytes
    cpu_s: float  # median CPU time (user + system) of the command
    cp_cpu_s: float  # median CPU time of the paired cp runs
    best_s: float  # the fastest run of the command, and of cp: the least disturbed
    cp_best_s: float


def paired(name: str, argv: list[str], out: Path, src: Path, scratch: Path) -> Paired:
    """One warm-up of each, then REPEAT pairs; the order within a pair alternates. A
    folder input is copied with `cp -r`."""
    cp_out = scratch / "cp.out"
    cp = ["cp", "-r", str(src), str(cp_out)] if src.is_dir() else ["cp", str(src), str(cp_out)]
    _fresh(cp, cp_out)
    _fresh(argv, out)
    runs, cps = [], []
    for i in range(REPEAT):
        first, second = (argv, cp) if i % 2 else (cp, argv)
        a = _fresh(first, *((out, cp_out) if first is argv else (cp_out, out)))
        b = _fresh(second, *((out, cp_out) if second is argv else (cp_out, out)))
        run, c = (a, b) if first is argv else (b, a)
        runs.append(run)
        cps.append(c)
    _remove(cp_out)
    return Paired(
        name,
        statistics.median(r.wall_s for r in runs),
        statistics.median(c.wall_s for c in cps),
        tuple(r.wall_s / c.wall_s for r, c in zip(runs, cps)),
        int(statistics.median(r.peak_rss_bytes for r in runs)),
        runs[-1].stdout,
        statistics.median(r.cpu_s for r in runs),
        statistics.median(c.cpu_s for c in cps),
        min(r.wall_s for r in runs),
        min(c.wall_s for c in cps),
    )


def _warm(path: Path) -> None:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for p in files:
        with open(p, "rb") as f:
            while f.read(64 * MiB):
                pass


def cases(src: Path, flat: Path, o: Path) -> list[tuple[str, list[str], Path, float]]:
    """(name, yafsdp arguments, the input that cp copies, wall bar as a multiple of cp)."""
    s, f = str(src), str(flat)
    return [
        ("convert -n 8", ["convert", s, "-o", str(o / "c.safetensors"), "-n", "8"], src, 1.5),
        ("convert -n 8 --sharded", ["convert", s, "-o", str(o / "cs"), "-n", "8", "--sharded"],
         src, 1.5),
        ("restore", ["restore", f, "-o", str(o / "r.safetensors")], flat, 1.5),
        ("reshard -n 4", ["reshard", f, "-n", "4", "-o", str(o / "s.safetensors")], flat, 1.5),
        ("reshard -n 8 --sharded", ["reshard", f, "-n", "8", "--sharded", "-o", str(o / "ss")],
         flat, 1.5),
    ]  # fmt: skip


def _output(argv: list[str]) -> Path:
    return Path(argv[argv.index("-o") + 1])


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    compile_package()
    print(f"  load average before: {os.getloadavg()[0]:.2f} (2 cores)")
    src = DATA / "llama-1.2g-fp32.safetensors"
    make_checkpoint(src)
    scratch = Path(tempfile.mkdtemp(dir=DATA))
    try:
        return _run_all(src, scratch) & sparse_70b(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"  load average after: {os.getloadavg()[0]:.2f}")


def _run_all(src: Path, scratch: Path) -> bool:
    flat = scratch / "flat.safetensors"
    _fresh([YAFSDP, "convert", str(src), "-o", str(flat), "-n", "8"], flat)
    _warm(src)
    _warm(flat)
    floor = median_run([PYTHON, "-c", "pass"], REPEAT)
    start_s, start_cpu = _startup(scratch, ["--json"])
    human_s, human_cpu = _startup(scratch, [])
    gib = src.stat().st_size / 1024**3
    print(f"  input {src.name}: {gib:.2f} GiB, {len(llama_shapes())} tensors")
    print(f"  interpreter floor (python -c pass): {floor.peak_rss_bytes / MiB:.0f} MiB RSS")
    print(
        f"  startup floor (yafsdp convert of a 12 KiB file --json): {start_s:.3f} s wall, "
        f"{start_cpu:.3f} s CPU (without --json: {human_s:.3f} s, {human_cpu:.3f} s), no bar"
    )
    ok = True
    for name, argv, cp_src, bar in cases(src, flat, scratch):
        p = paired(name, [YAFSDP, *argv, "--json"], _output(argv), cp_src, scratch)
        spread = ", ".join(f"{r:.2f}" for r in p.ratios)
        print(
            f"  {name}: {p.wall_s:.3f} s beside cp {p.cp_s:.3f} s (pairs: {spread}); "
            f"CPU {p.cpu_s:.3f} s beside cp {p.cp_cpu_s:.3f} s ({p.cpu_s / p.cp_cpu_s:.2f}x; "
            f"{(p.cpu_s - start_cpu) / p.cp_cpu_s:.2f}x without the startup floor's CPU); "
            f"fastest {p.best_s:.3f} s beside cp {p.cp_best_s:.3f} s "
            f"({p.best_s / p.cp_best_s:.2f}x); {p.peak_rss_bytes / MiB:.0f} MiB RSS"
        )
        ok &= verdict(f"{name} wall / cp", p.wall_s / p.cp_s, bar, "x")
        rss_bar = (floor.peak_rss_bytes + 100e6) / MiB
        ok &= verdict(f"{name} peak RSS", p.peak_rss_bytes / MiB, rss_bar, "MiB")
        _remove(_output(argv))
    return ok


def _startup(scratch: Path, flags: list[str]) -> tuple[float, float]:
    """Median wall and CPU seconds of `yafsdp convert` of the 12 KiB sample model."""
    tiny = scratch / "tiny.safetensors"
    mlp = str(ROOT / "sample_models" / "mlp.safetensors")
    argv = [YAFSDP, "convert", mlp, "-o", str(tiny), *flags]
    starts = [_fresh(argv, tiny) for _ in range(REPEAT)]
    return statistics.median(r.wall_s for r in starts), statistics.median(r.cpu_s for r in starts)


def keeps_holes(folder: Path) -> bool:
    probe = folder / "hole-probe"
    with open(probe, "wb") as f:
        f.truncate(64 * MiB)
        f.write(b"x")
    sparse = os.stat(probe).st_blocks * 512 < MiB
    probe.unlink()
    return sparse


def sparse_70b(scratch: Path) -> bool:
    """convert of the 70B-shaped sparse file to a sparse flat file, beside cp."""
    from .bench_inspect_70b import write_sparse

    if not keeps_holes(scratch):
        print("  70B sparse: skipped (this file system does not keep holes)")
        return True
    src = DATA / "llama70b.safetensors"
    size = write_sparse(src)
    out, cp_out = scratch / "70b.flat.safetensors", scratch / "70b.cp"
    argv = [YAFSDP, "convert", str(src), "-o", str(out), "-n", "8", "--json"]
    cp = ["cp", "--sparse=always", str(src), str(cp_out)]
    runs, cps, blocks = [], [], 0
    for i in range(REPEAT):
        order = [(argv, out), (cp, cp_out)] if i % 2 else [(cp, cp_out), (argv, out)]
        for command, target in order:
            (runs if command is argv else cps).append(_fresh(command, target))
        blocks = os.stat(out).st_blocks * 512
        _remove(out)
        _remove(cp_out)
    wall, cp_wall = (statistics.median(r.wall_s for r in x) for x in (runs, cps))
    print(
        f"  70B sparse: {size / 1e9:.1f} GB file, convert -n 8 {wall:.3f} s beside "
        f"cp --sparse=always {cp_wall:.3f} s; output uses {blocks / MiB:.1f} MiB of disk"
    )
    # No wall bar: cp finds the one hole with SEEK_HOLE in
    # milliseconds, so the figure is yafsdp's startup and header work. Holes must stay.
    return verdict("70B output on disk", blocks / MiB, 100, "MiB")


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
