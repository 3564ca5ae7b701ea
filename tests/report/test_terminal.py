"""The terminal: the per-rank memory bars under the tables (colour only on a TTY,
NO_COLOR honoured, a glyph per category otherwise) and the progress bars (stderr
only, never under --json, never off a terminal)."""

from __future__ import annotations

import io
import json
import re

import pytest
from helpers import options
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from tests.conftest import SAMPLES
from yafsdp_cli.cli import app
from yafsdp_cli.cli.progress import StageBar, WaitBar
from yafsdp_cli.inspection.build import inspect_model
from yafsdp_cli.inspection.inspect_options import InspectOptions
from yafsdp_cli.report.bars import GLYPHS, BarRow, StackedBars, cells
from yafsdp_cli.report.formatting import human_bytes
from yafsdp_cli.report.inspect_view import memory_bars
from yafsdp_cli.sources import load_source

runner = CliRunner()
LLAMA = str(SAMPLES / "llama.safetensors")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def render(renderable, **console) -> str:
    out = io.StringIO()
    Console(file=out, width=100, **console).print(renderable)
    return out.getvalue()


@given(
    st.lists(st.integers(0, 10**15), min_size=1, max_size=8),
    st.integers(1, 200),
    st.integers(0, 10**15),
)
def test_cells_fill_each_rows_share_of_the_width(parts, width, extra):
    scale = sum(parts) + extra
    got = cells(parts, scale, width)
    assert all(n >= 0 for n in got)
    assert sum(got) == (round(sum(parts) * width / scale) if scale else 0)
    assert sum(got) <= width


def llama_report():
    return inspect_model(load_source(LLAMA), options(InspectOptions, world_size=8))


def llama_bars():
    return memory_bars(llama_report())


def test_bars_on_a_pipe_use_a_glyph_per_category_and_no_colour():
    text = render(llama_bars(), color_system=None)
    assert not ANSI.search(text)
    lines = text.splitlines()
    assert lines[0].startswith("per rank at world size 8")
    ddp = next(line for line in lines if line.startswith("DDP (baseline)"))
    assert len(set(ddp) & set(GLYPHS)) >= 3  # params, grads, optimizer states, ...
    ddp_total = llama_report().memory.baseline_bytes
    assert ddp.rstrip().endswith(human_bytes(ddp_total))
    # the legend names every category with its glyph
    assert all(f"{g} " in lines[-1] for g in GLYPHS)


def test_bars_on_a_tty_are_coloured_and_no_color_turns_that_off(monkeypatch):
    coloured = render(llama_bars(), force_terminal=True, color_system="truecolor")
    assert ANSI.search(coloured) and "▓" not in coloured  # colour, so one glyph for all
    monkeypatch.setenv("NO_COLOR", "1")
    plain = render(llama_bars(), force_terminal=True, color_system="truecolor")
    assert not re.search(r"\x1b\[[0-9;]*38;", plain)  # no foreground colours
    assert "▓" in plain  # the glyphs carry the categories instead


def test_rows_share_one_scale_and_show_their_totals():
    bars = StackedBars("t", ("a", "b"), (BarRow("big", (600, 400)), BarRow("small", (250, 0))))
    text = render(bars, color_system=None)
    big = next(line for line in text.splitlines() if line.startswith("big"))
    small = next(line for line in text.splitlines() if line.startswith("small"))
    assert small.count(GLYPHS[0]) * 4 == pytest.approx(
        big.count(GLYPHS[0]) + big.count(GLYPHS[1]), abs=4
    )
    assert big.rstrip().endswith(human_bytes(1000)) and small.rstrip().endswith("250 B")


def test_inspect_table_prints_the_bars_under_the_memory_table():
    result = runner.invoke(app, ["inspect", LLAMA, "-n", "8"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("memory per rank at world size 8") < out.index("per rank at world size 8 (one")
    assert out.index("(one scale") < out.index("Notes")
    assert not ANSI.search(out)  # CliRunner's stdout is no TTY
    json_out = runner.invoke(app, ["inspect", LLAMA, "-n", "8", "--json"]).stdout
    json.loads(json_out)  # one document, no bars


def test_profile_table_prints_the_peak_bars():
    result = runner.invoke(app, ["profile", "--model", "sample_models.models:mlp"])
    assert result.exit_code == 0, result.output
    assert "peak of the step by category (one scale)" in result.stdout
    assert re.search(r"^converted .* [+-]\d+\.\d%$", result.stdout, flags=re.M)


def tty() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def test_stage_bar_shows_the_stage_on_its_console_after_the_delay(monkeypatch):
    monkeypatch.setattr(StageBar, "DELAY_S", 0.0)
    console, out = tty()
    with StageBar(True, "profile", total=4, console=console) as bar:
        bar("original step", 1, 4)
        bar.bar.refresh()
        assert "profile: original step" in out.getvalue() and "1/4" in out.getvalue()
    assert bar.bar is None and bar.closed


def test_bars_stay_off_when_disabled_or_off_a_terminal(monkeypatch):
    monkeypatch.setattr(StageBar, "DELAY_S", 0.0)
    console, out = tty()
    with StageBar(False, "profile", total=4, console=console) as bar:  # --json
        bar("original step", 1, 4)
    pipe = Console(file=io.StringIO())  # not a terminal
    with WaitBar(True, "verify on 2 ranks", console=pipe) as wait:
        assert not wait.enabled
    assert out.getvalue() == "" and bar.bar is None


def test_a_stage_bar_closed_before_its_delay_never_shows():
    console, out = tty()
    with StageBar(True, "profile", total=4, console=console) as bar:
        assert bar.timer.is_alive()  # waiting out DELAY_S
    bar.timer.join()  # cancelled: a quick run shows no bar
    assert out.getvalue() == "" and bar.bar is None


def test_profile_reports_every_stage_in_order():
    from yafsdp_cli.profiling import ProfileOptions, profile_source
    from yafsdp_cli.profiling.profiler import STAGES

    seen = []
    profile_source(
        None,
        model="sample_models.models:mlp",
        opts=ProfileOptions(),
        progress=lambda *a: seen.append(a),
    )
    n = len(STAGES)
    assert seen == [(s, i, n) for i, s in enumerate(STAGES)] + [("done", n, n)]


@pytest.mark.parametrize("json_out", [False, True])
def test_profile_cli_progress_goes_to_stderr_and_never_under_json(monkeypatch, json_out):
    from yafsdp_cli.cli import progress

    console, out = tty()
    monkeypatch.setattr(progress, "stderr", console)  # a terminal on stderr
    monkeypatch.setattr(StageBar, "DELAY_S", 0.0)
    argv = ["profile", "--model", "sample_models.models:mlp", *(["--json"] if json_out else [])]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "profile:" not in result.stdout  # never on stdout
    if json_out:
        json.loads(result.stdout)
        assert out.getvalue() == ""
    else:
        assert "profile: " in out.getvalue()


def test_a_headers_own_line_break_is_kept_and_a_files_control_characters_escaped():
    from yafsdp_cli.report.formatting import Section, printable_section

    s = printable_section(Section("t\x1b[2J", ("micro-\nbatch", "x\x1b"), (("a\nb", "c"),)))
    assert s.headers == ("micro-\nbatch", "x\\x1b")
    assert s.title == "t\\x1b[2J" and s.rows == (("a\\nb", "c"),)
