"""`yafsdp inspect --json` of a Llama-2-70B-shaped safetensors file, beside the floor.

Bars (PRODUCT.md): wall time at most 1.3x ``python -c "import torch"``, peak RSS at
most that floor + 100 MB; ``inspect --html`` of the same file at 256 ranks under 2 s
and a page under 2 MB,
timed interleaved with ``inspect --json`` so the page's own cost shows. The file is
sparse (a real 723-tensor header, then a hole of ~138 GB made with ``truncate``), so
it uses no disk; inspect reads only the header. If transformers is installed, a 70B
Llama config folder (``config.json`` alone) is timed too; that figure has no bar.

python -m benchmarks.run inspect_70b
"""

from __future__ import annotations

import json
import statistics
import struct
from pathlib import Path

from .common import DATA, YAFSDP, MiB, import_floor, measure, median_run, verdict

VOCAB, HIDDEN, LAYERS, INTER, KV = 32000, 8192, 80, 28672, 1024


def llama_70b_header() -> dict:
    """Llama-2-70B tensor shapes (64 heads, 8 KV heads), bf16, in safetensors order."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
    shapes["model.norm.weight"] = (HIDDEN,)
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(shapes):
        n = 2
        for d in shapes[name]:
            n *= d
        header[name] = {
            "dtype": "BF16",
            "shape": list(shapes[name]),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    return header


def write_sparse(path: Path) -> int:
    """The header, then a hole as long as the data; returns the file size."""
    header = llama_70b_header()
    data_len = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + data_len)
    return 8 + len(raw) + data_len


def write_config_folder(folder: Path) -> bool:
    try:
        from transformers import LlamaConfig
    except ImportError:
        return False
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=64,
        num_key_value_heads=8,
        dtype="bfloat16",
    ).save_pretrained(folder)
    return True


def main() -> bool:
    path = DATA / "llama70b.safetensors"
    size = write_sparse(path)
    floor = import_floor()
    run = median_run([YAFSDP, "inspect", str(path), "--json", "--world-size", "256"], repeat=5)
    doc = json.loads(run.stdout)
    ok_run = run.returncode == 0 and doc["params"]["total_count"] == 723
    print(
        f"  file: {path.name}, {size / 1e9:.1f} GB sparse, {doc['params']['total_count']} tensors"
    )
    print(f"  floor (import torch): {floor.wall_s:.3f} s, {floor.peak_rss_bytes / MiB:.1f} MiB")
    print(f"  inspect --json:       {run.wall_s:.3f} s, {run.peak_rss_bytes / MiB:.1f} MiB")
    ok_wall = verdict("wall time", run.wall_s, 1.3 * floor.wall_s, "s")
    rss_bar = (floor.peak_rss_bytes + 100 * MiB) / MiB
    ok_rss = verdict("peak RSS", run.peak_rss_bytes / MiB, rss_bar, "MiB")
    ok_html = html_bar(path)
    folder = DATA / "llama70b-config"
    if write_config_folder(folder):
        hf = median_run([YAFSDP, "inspect", str(folder), "--json", "-n", "256"], repeat=3)
        print(
            f"  HF config folder (no bar): {hf.wall_s:.3f} s, "
            f"{hf.peak_rss_bytes / MiB:.1f} MiB, exit {hf.returncode}"
        )
    else:
        print("  HF config folder: skipped (transformers not installed)")
    return ok_run and ok_wall and ok_rss and ok_html


def html_bar(path: Path, repeat: int = 5) -> bool:
    """``inspect --html`` (the table on stdout too, as a user runs it) against
    ``inspect --json``, alternating, medians."""
    page = DATA / "llama70b.html"
    html_argv = [YAFSDP, "inspect", str(path), "--world-size", "256", "--html", str(page)]
    json_argv = [YAFSDP, "inspect", str(path), "--world-size", "256", "--json"]
    measure(html_argv)  # warm-up
    pairs = [(measure(json_argv), measure(html_argv)) for _ in range(repeat)]
    ok_run = all(h.returncode == 0 for _, h in pairs)
    base = statistics.median(j.wall_s for j, _ in pairs)
    wall = statistics.median(h.wall_s for _, h in pairs)
    size = page.stat().st_size
    print(f"  inspect --json (paired): {base:.3f} s; inspect --html: {wall:.3f} s, page {size:,} B")
    ok_wall = verdict("--html wall time", wall, 2.0, "s")
    ok_size = verdict("--html page size", size / 1e6, 2.0, "MB")
    return ok_run and ok_wall and ok_size
