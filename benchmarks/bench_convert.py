"""Bar: `yafsdp convert` of a ~1.2 GiB fp32 safetensors checkpoint.

    wall   <= 2.0 x (cp of the same file + python -c "import torch")
    RSS    <= RSS of python -c "import torch" + 256 MiB

The input is a Llama-shaped fp32 checkpoint (4 decoder layers, hidden 2048,
intermediate 5504, vocabulary 32000, untied head: 1.24 GiB) written once under
benchmarks/data/ (git-ignored) with pseudo-random bytes. Page cache: the file is
read once before any timing, so cp and convert both read it warm; every output is
deleted and ``sync`` run before each run (outside the timing), so both write fresh
files into a clean page cache with no writeback of an earlier run in flight (neither
fsyncs). Each figure is the median of 3 runs after a warm-up run.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import tempfile
from pathlib import Path

from .common import DATA, YAFSDP, MiB, Run, import_floor, measure, verdict

LAYERS, HIDDEN, INTER, VOCAB = 4, 2048, 5504, 32000
REPEAT = 3


def llama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
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


def make_checkpoint(path: Path) -> None:
    """A plain safetensors file (header by hand: this must not depend on yafsdp)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in llama_shapes():
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


def fresh_runs(argv: list[str], out: Path) -> Run:
    """Median of REPEAT runs after a warm-up; ``out`` is deleted before each."""
    runs = []
    for _ in range(REPEAT + 1):
        _remove(out)
        os.sync()  # no writeback of an earlier run's output competes with this one
        runs.append(measure(argv))
        if runs[-1].returncode != 0:
            raise SystemExit(f"{argv[0]} failed with exit code {runs[-1].returncode}")
    runs = runs[1:]
    _remove(out)
    return Run(
        statistics.median(r.wall_s for r in runs),
        int(statistics.median(r.peak_rss_bytes for r in runs)),
        0,
        runs[-1].stdout,
    )


def _remove(path: Path) -> None:
    if path.exists():
        path.unlink()


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    src = DATA / "llama-1.2g-fp32.safetensors"
    make_checkpoint(src)
    size = src.stat().st_size
    with open(src, "rb") as f:  # warm the page cache for both contenders
        while f.read(64 * MiB):
            pass
    out_dir = Path(tempfile.mkdtemp(dir=DATA))
    cp_out, flat_out = out_dir / "copy.safetensors", out_dir / "flat.safetensors"
    floor = import_floor()
    cp = fresh_runs(["cp", str(src), str(cp_out)], cp_out)
    argv = [YAFSDP, "convert", str(src), "-o", str(flat_out), "--world-size", "8", "--json"]
    conv = fresh_runs(argv, flat_out)
    out_dir.rmdir()
    doc = json.loads(conv.stdout)
    gib = size / 1024**3
    print(f"  input {src.name}: {gib:.2f} GiB, {len(llama_shapes())} tensors")
    print(
        f"  floors: cp {cp.wall_s:.3f} s ({size / cp.wall_s / 1e9:.2f} GB/s), "
        f"import torch {floor.wall_s:.3f} s / {floor.peak_rss_bytes / MiB:.0f} MiB RSS"
    )
    print(
        f"  convert: {conv.wall_s:.3f} s ({size / conv.wall_s / 1e9:.2f} GB/s), "
        f"{conv.peak_rss_bytes / MiB:.0f} MiB RSS, wrote {doc['checkpoint']['nbytes']} bytes"
    )
    ok = verdict("convert wall", conv.wall_s, 2.0 * (cp.wall_s + floor.wall_s), "s")
    rss_bar = (floor.peak_rss_bytes + 256 * MiB) / MiB
    return verdict("convert peak RSS", conv.peak_rss_bytes / MiB, rss_bar, "MiB") and ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
