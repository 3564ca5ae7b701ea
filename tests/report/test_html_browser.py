"""The HTML pages in a real browser (headless Chromium): they render, the SVG has one
bar per buffer, the numbers on screen equal `inspect --json`'s, the expand control
shows the folded buffers, hovering names the parameter and the rank, nothing is
fetched from anywhere. Skips, saying why, only where no browser is installed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.bench_inspect_70b import write_sparse
from tests.browser import Browser, skip_reason
from tests.conftest import SAMPLES
from yafsdp_cli.cli import app
from yafsdp_cli.report.formatting import human_bytes

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
runner = CliRunner()

# What the page shows, read back from the rendered DOM (visible text, not the source).
READ_PAGE = """
const out = {buffers: [], schemes: []};
for (const svg of document.querySelectorAll('svg.buffer-bar')) {
  const box = svg.closest('.buf');
  const f = k => box.querySelector('[data-f="' + k + '"]');
  out.buffers.push({
    name: svg.dataset.buffer,
    visible: svg.checkVisibility(),
    numel: f('numel').innerText, padded: f('padded_numel').innerText,
    padding: f('padding_numel').innerText, entries: f('entries').innerText,
    shard: f('shard_numel') ? f('shard_numel').innerText : null,
    rects: [...svg.querySelectorAll('rect.e')].map(r => [Number(r.dataset.o),
      Number(r.dataset.n), r.getBoundingClientRect().width]),
    width: svg.getBoundingClientRect().width,
  });
}
for (const row of document.querySelectorAll('.stack[data-kind="memory"] .stack-row')) {
  out.schemes.push({scheme: row.dataset.row,
    total: row.querySelector('.stack-total').innerText,
    parts: [...row.querySelectorAll('rect[data-bytes]')].map(r => Number(r.dataset.bytes))});
}
out.resources = performance.getEntriesByType('resource').map(r => r.name);
return out;
"""


@pytest.fixture(scope="module")
def browser():
    with Browser(1280, 1400) as b:
        yield b


def inspect_to(tmp_path: Path, *args: str) -> tuple[dict, Path]:
    page = tmp_path / "page.html"
    result = runner.invoke(app, ["inspect", *args, "--json", "--html", str(page)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), page


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def check_shown(doc: dict, shown: dict) -> None:
    by_name = {b["name"]: b for b in doc["buffers"]}
    assert len(shown["buffers"]) == len(doc["buffers"])  # one SVG element per buffer
    assert {b["name"] for b in shown["buffers"]} == set(by_name)
    for b in shown["buffers"]:
        want = by_name[b["name"]]
        assert b["numel"] == f"{want['numel']:,}" and b["padded"] == f"{want['padded_numel']:,}"
        assert b["padding"] == f"{want['padding_numel']:,}"
        assert int(b["entries"]) == len(want["entries"])
        if doc["inputs"]["world_size"] > 1:
            assert b["shard"] == f"{want['shard_numel']:,}"
        assert [r[:2] for r in b["rects"]] == [[e["offset"], e["numel"]] for e in want["entries"]]
        if b["visible"]:  # drawn to scale: an entry's width is its share of the buffer
            for _, numel, px in b["rects"]:
                assert px == pytest.approx(b["width"] * numel / want["padded_numel"], abs=1.0)
    schemes = doc["memory"]["schemes"]
    assert [s["scheme"] for s in shown["schemes"]] == [s["scheme"] for s in schemes]
    fields = ("params", "grads", "optimizer", "master", "buffers", "gather", "reduce")
    for got, want in zip(shown["schemes"], schemes):
        assert got["total"] == human_bytes(want["total"])
        assert got["parts"] == [want[f] for f in fields]
    assert shown["resources"] == []  # nothing fetched: the page is one file


def test_sample_page_renders_with_the_json_numbers(browser, tmp_path):
    doc, page = inspect_to(tmp_path, str(SAMPLES / "llama.safetensors"), "-n", "8")
    browser.open(page)
    shot = tmp_path / "llama.png"
    browser.screenshot(shot)
    assert png_size(shot) == (1280, pytest.approx(1400, abs=200))
    assert shot.stat().st_size > 20_000  # something was drawn, not a blank page
    browser.js("document.getElementById('expand-all').click()")  # folded text reads as ''
    check_shown(doc, browser.js(READ_PAGE))


def test_70b_page_folds_expands_and_names_what_is_under_the_cursor(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    header = tmp_path / "llama70b.safetensors"
    write_sparse(header)
    doc, page = inspect_to(tmp_path, str(header), "-n", "256")
    browser.open(page)
    shown = browser.js(READ_PAGE)
    assert len(shown["buffers"]) == 81
    assert sum(b["visible"] for b in shown["buffers"]) == 2  # the root and model.layers.0
    browser.js("document.getElementById('expand-all').click()")
    shown = browser.js(READ_PAGE)
    assert all(b["visible"] for b in shown["buffers"])
    check_shown(doc, shown)
    browser.screenshot(tmp_path / "70b.png")
    # the cursor over the first tenth of model.layers.0's bar: down_proj, on rank 12 of 256
    svg = browser.driver.find_element(
        "css selector", 'svg[data-buffer="__flat__.model.layers.0.bfloat16"]'
    )
    width = svg.rect["width"]
    ActionChains(browser.driver).move_to_element_with_offset(
        svg, -width / 2 + width * 0.05, 0
    ).perform()
    tip = browser.js("return document.getElementById('tip').textContent")
    layer = next(b for b in doc["buffers"] if b["unit"] == "model.layers.0")
    at = 0.05 * layer["padded_numel"]
    hit = next(e for e in layer["entries"] if e["offset"] <= at < e["offset"] + e["numel"])
    assert hit["name"] == "model.layers.0.mlp.down_proj.weight"  # the tiny norms come first
    assert hit["name"] in tip and "shape (8192, 28672)" in tip and "bf16" in tip
    assert f"offset {hit['offset']:,}" in tip
    rank = int(tip.split("under the cursor: rank ")[1].split()[0])
    assert rank == pytest.approx(0.05 * 256, abs=1)  # 5% of the way along 256 equal shards


def test_rescale_button_draws_each_bar_to_its_own_length(browser, tmp_path):
    _, page = inspect_to(tmp_path, str(SAMPLES / "llama.safetensors"), "-n", "8")
    browser.open(page)
    widths = """return [...document.querySelectorAll('.stack[data-kind="memory"] .stack-row')]
      .map(r => [...r.querySelectorAll('rect[data-bytes]')]
      .reduce((s, e) => s + e.getBoundingClientRect().width, 0));"""
    before = browser.js(widths)
    assert max(before) > 2 * min(before)  # one scale: DDP is far longer than flat
    browser.js("document.querySelector('button.rescale').click()")
    after = browser.js(widths)
    assert max(after) == pytest.approx(min(after), abs=1.0)


def test_profile_page_renders_both_series(browser, tmp_path):
    page = tmp_path / "profile.html"
    argv = ["profile", "--model", "sample_models.models:mlp", "-n", "2", "--html", str(page)]
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    browser.open(page)
    paths = browser.js(
        "return [...document.querySelectorAll('path.series')].map(p => "
        "[p.dataset.variant, Number(p.dataset.peak), p.getBoundingClientRect().width])"
    )
    assert [p[0] for p in paths] == ["original", "converted"]
    assert [p[1] for p in paths] == [doc["original"]["peak_bytes"], doc["converted"]["peak_bytes"]]
    assert all(p[2] > 500 for p in paths)  # drawn across the chart
    browser.screenshot(tmp_path / "profile.png")


def test_plan_page_says_what_the_terminal_says(browser, tmp_path):
    """The page's visible text: the answer first, each cell's needed bytes and the
    terminal's verdict, the legend, plurals, and no control that does nothing."""
    page = tmp_path / "plan.html"
    argv = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "900MiB"]
    argv += ["--world-size", "1,2", "--micro-batch", "1,2", "--seq-len", "16"]
    result = runner.invoke(app, [*argv, "--html", str(page), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    browser.open(page)
    shot = tmp_path / "plan.png"
    browser.screenshot(shot)
    assert shot.stat().st_size > 10_000  # something was drawn
    text = browser.js("return document.body.innerText")
    assert text.index(doc["answer"][0]) < text.index("Will it fit?")  # the answer first
    for line in doc["answer"][1:]:
        assert line in text
    for r in doc["rows"]:
        assert f"{human_bytes(r['needed_bytes'])} {'fits' if r['fits'] else 'OOM'}" in text
    assert "fits, keeping the margin free" in text and "OOM: above the GPU's memory" in text
    assert "1 GPU\t" in text or "1 GPU\n" in text
    assert "1 GPUs" not in text and "expand all" not in text
    assert "Peak per rank" not in text and "Needed per rank" in text
