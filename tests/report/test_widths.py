"""Every command's tables at 60, 80 and 120 columns: no column of zero width, no word
broken across lines or cropped inside a cell, and no two different names shortened to
the same text.

Each command runs once (through the CLI); what it hands the terminal is then printed
by the CLI's own ``print_lines`` on consoles of each width, and once at 1,000 columns,
where nothing wraps: every word printed at a narrow width must be one printed wide
(``non-reentr``, ``float3``, ``st`` for ``step`` and ``…yernorm`` are none).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.conftest import SAMPLES
from tests.terminal_text import layout_problems, words
from yafsdp_cli.cli import app, command_kit, convert_cmd, flags
from yafsdp_cli.report.fit_table import FitTable, fold_name

runner = CliRunner()
WIDTHS = (60, 80, 120)
WIDE = 1000
LLAMA = str(SAMPLES / "llama.safetensors")
# Llama-3-8B's config: a folder without weights, as inspect reads it
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def captured(args: list[str], exit_code: int = 0, cwd: Path | None = None) -> list:
    """What the command hands the terminal (its renderables)."""
    shown: list = []
    original = flags.print_lines

    def keep(renderables) -> None:
        shown.extend(renderables)

    flags.print_lines = convert_cmd.print_lines = keep
    try:
        result = runner.invoke(app, args)
    finally:
        flags.print_lines = convert_cmd.print_lines = original
    assert result.exit_code == exit_code, result.output
    assert shown, f"{args} printed no table"
    return shown


def printed(renderables: list, width: int) -> str:
    """``renderables`` through the CLI's own ``print_lines`` at ``width`` columns."""
    out = io.StringIO()
    command_kit.stdout._console = Console(
        file=out, width=width, highlight=False, soft_wrap=False, color_system=None
    )
    try:
        flags.print_lines(renderables)
    finally:
        command_kit.stdout._console = None
    return out.getvalue()


def name_folds(renderables: list, width: int) -> list[str]:
    """Each name column's cells as a table of ``width`` columns folds them: two
    different names must never read the same."""
    problems = []
    console = Console(width=width, file=io.StringIO())
    for r in renderables:
        if not isinstance(r, FitTable):
            continue
        for indices, widths in r.parts(console, console.options):
            for i, w in zip(indices, widths):
                column = r.columns[i]
                if not (column.name and column.fold):
                    continue
                names = {c.text for c in column.cells if c.text}
                folded = {fold_name(n, w) for n in names}
                if len(folded) != len(names):
                    problems.append(f"{column.header!r} at {w} columns: {sorted(folded)}")
    return problems


def problems(renderables: list) -> list[str]:
    wide = printed(renderables, WIDE)
    found = []
    for width in WIDTHS:
        found += layout_problems(printed(renderables, width), wide, width)
        found += [f"{width}: {p}" for p in name_folds(renderables, width)]
    return found


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("widths")


def test_the_word_splitter():
    assert words("non-reentr\nant") == {"non-reentr", "ant"}
    assert words("│ …input_layernorm.weight │ 2.39 GiB") == {
        "input_layernorm", "weight", "2.39", "GiB"}  # fmt: skip
    assert words("model.layers.0.mlp lm_head.weight[0:4,096]") == {
        "model", "layers", "0", "mlp", "lm_head", "weight", "[0:4,096]"}  # fmt: skip
    assert "2." in words("keeping 2.\n39 GiB free")


def test_the_checks_catch_what_rich_does_to_a_narrow_table():
    """A plain Rich table at 60 columns: columns of no width and words cut."""
    from rich.table import Table

    table = Table(title="Worst tensors")
    for h in ("", "kind", "name", "step", "dtype", "max abs", "max rel"):
        table.add_column(h, no_wrap=h == "name")
    for i in range(3):
        table.add_row("ok", "gradient", f"model.layers.{i}.post_attention_layernorm.weight",
                      "0", "float32", "0", "0")  # fmt: skip
    found = problems([table])
    assert any("no width" in p for p in found), found
    assert any("broken or cut" in p for p in found), found


PLAN = ["plan", "--model", "sample_models.models:gpt", "--seq-len", "32", "--world-size",
        "1,16", "--micro-batch", "1,2,4,8", "--jobs", "1", "--gpu", "h100-sxm",
        "--scheme", "all"]  # fmt: skip


def test_plan_with_a_gpu_and_every_scheme():
    found = problems(captured(PLAN))
    assert not found, "\n".join(found)


def test_profile():
    args = ["profile", LLAMA, "--model", "sample_models.models:llama", "--world-size", "4"]
    found = problems(captured(args))
    assert not found, "\n".join(found)


def test_inspect_of_the_sample_llama():
    found = problems(captured(["inspect", LLAMA, "-n", "8"]))
    assert not found, "\n".join(found)


def test_inspect_of_a_llama_3_8b_config(work):
    pytest.importorskip("transformers")
    folder = work / "llama-3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    shown = captured(["inspect", str(folder), "-n", "8"])
    found = problems(shown)
    assert not found, "\n".join(found)
    # the two norms of a layer stay two names at 80 columns
    text = printed(shown, 80)
    assert "input_layernorm.weight" in text and "post_attention_layernorm.weight" in text


def test_verify():
    args = ["verify", LLAMA, "--model", "sample_models.models:llama", "--steps", "1"]
    found = problems(captured(args))
    assert not found, "\n".join(found)


def test_check_failing_with_modules(work):
    base = work / "llama.mem.json"
    model = ["--model", "sample_models.models:llama"]
    done = runner.invoke(app, ["check", *model, "-b", str(base), "--update", "-n", "8",
                               "--seq-len", "64"])  # fmt: skip
    assert done.exit_code == 0, done.output
    shown = captured(["check", "-b", str(base), "--seq-len", "128", "--min-bytes", "0"], 1)
    found = problems(shown)
    assert not found, "\n".join(found)


def test_convert(work):
    out = work / "llama-flat"
    found = problems(captured(["convert", LLAMA, "-n", "8", "--sharded", "-o", str(out)]))
    assert not found, "\n".join(found)
