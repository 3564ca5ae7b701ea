"""`--html FILE` without a browser: the page's elements and numbers against the JSON
documents, self-containment, folding, the write (atomic, refusals), profile and check
pages, and the plan heat map hook. tests/report/test_html_browser.py renders them for real."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import options
from typer.testing import CliRunner

from benchmarks.bench_inspect_70b import write_sparse
from tests.conftest import SAMPLES
from yafsdp_cli.cli import app
from yafsdp_cli.inspection.build import inspect_model
from yafsdp_cli.inspection.inspect_options import InspectOptions
from yafsdp_cli.memory.headroom import fit_by_share
from yafsdp_cli.report.formatting import human_bytes
from yafsdp_cli.report.html_pages import inspect_page, plan_heatmap
from yafsdp_cli.sources import load_source

runner = CliRunner()
LLAMA = str(SAMPLES / "llama.safetensors")


class Dom(HTMLParser):
    """Every element as {tag, attrs, text (its descendants' text), in_details}, in
    document order."""

    VOID = ("meta", "br", "input", "img", "link")

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[dict] = []
        self.stack: list[dict] = []
        self.feed(text)

    def _element(self, tag, attrs) -> dict:
        inside = any(e["tag"] == "details" for e in self.stack)
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "in_details": inside}
        self.elements.append(el)
        return el

    def handle_starttag(self, tag, attrs):
        el = self._element(tag, attrs)
        if tag not in self.VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self._element(tag, attrs)

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for el in self.stack:
            el["text"] += data

    def find(self, tag: str | None = None, **attrs) -> list[dict]:
        """Elements of ``tag`` whose attributes equal ``attrs`` (``_`` for ``-``;
        ``True``: present)."""

        def ok(e) -> bool:
            if tag is not None and e["tag"] != tag:
                return False
            for key, want in attrs.items():
                have = e["attrs"].get(key.rstrip("_").replace("_", "-"))
                if have is None or (want is not True and have != want):
                    return False
            return True

        return [e for e in self.elements if ok(e)]


def write_page(tmp_path: Path, *args: str) -> tuple[dict, Path]:
    page = tmp_path / "report.html"
    result = runner.invoke(app, ["inspect", *args, "--json", "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert f"wrote {page}" in result.stderr
    return json.loads(result.stdout), page


def buffers_of(dom: Dom) -> list[dict]:
    return dom.find("svg", class_="buffer-bar")


def entries_by_buffer(dom: Dom) -> dict[str, list[dict]]:
    """Each buffer's entry rects (they follow their svg in document order)."""
    out: dict[str, list[dict]] = {}
    current = None
    for el in dom.elements:
        if el["tag"] == "svg" and el["attrs"].get("class") == "buffer-bar":
            current = out.setdefault(el["attrs"]["data-buffer"], [])
        elif el["tag"] == "svg":
            current = None
        elif el["tag"] == "rect" and el["attrs"].get("class") == "e":
            current.append(el)
    return out


def check_numbers(doc: dict, dom: Dom) -> None:
    """Every buffer and every scheme the JSON has, with the same numbers."""
    svgs = {s["attrs"]["data-buffer"]: s["attrs"] for s in buffers_of(dom)}
    assert len(svgs) == len(buffers_of(dom)) == len(doc["buffers"])  # one svg per buffer
    rects = entries_by_buffer(dom)
    for b in doc["buffers"]:
        a = svgs[b["name"]]
        assert int(a["data-numel"]) == b["numel"]
        assert int(a["data-padded"]) == b["padded_numel"]
        assert int(a["data-shard"]) == b["shard_numel"]
        assert int(a["data-ws"]) == doc["inputs"]["world_size"]
        drawn = [(int(r["attrs"]["data-o"]), int(r["attrs"]["data-n"])) for r in rects[b["name"]]]
        assert drawn == [(e["offset"], e["numel"]) for e in b["entries"]]
        for r, e in zip(rects[b["name"]], b["entries"]):
            assert r["text"].startswith(e["name"] + "\n"), r["text"]
            assert f"offset {e['offset']:,}" in r["text"]
            assert all(alias in r["text"] for alias in e["aliases"])
    # the numbers printed beside each bar, in page order
    order = [s["attrs"]["data-buffer"] for s in buffers_of(dom)]
    by_name = {b["name"]: b for b in doc["buffers"]}
    for field in ("numel", "padded_numel", "padding_numel"):
        shown = [int(s["text"].replace(",", "")) for s in dom.find("span", data_f=field)]
        assert shown == [by_name[n][field] for n in order], field
    shown = [int(s["text"]) for s in dom.find("span", data_f="entries")]
    assert shown == [len(by_name[n]["entries"]) for n in order]
    totals = dom.find("div", class_="stack-total")
    schemes = doc["memory"]["schemes"]
    assert [int(t["attrs"]["data-bytes"]) for t in totals] == [s["total"] for s in schemes]
    assert [t["text"] for t in totals] == [human_bytes(s["total"]) for s in schemes]
    parts = [int(r["attrs"]["data-bytes"]) for r in dom.find("rect", data_cat=True)]
    fields = ("params", "grads", "optimizer", "master", "buffers", "gather", "reduce")
    assert parts == [s[f] for s in schemes for f in fields]


def test_inspect_page_shows_every_buffer_and_the_json_numbers(tmp_path):
    doc, page = write_page(tmp_path, LLAMA, "-n", "8")
    text = page.read_text()
    check_numbers(doc, Dom(text))
    # Written through a temporary file: nothing else beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


@pytest.mark.parametrize(
    "args",
    [
        [str(SAMPLES / "gpt.pt")],  # shared storage: a tied entry with aliases
        ["--model", "sample_models.models:moe", "-n", "3", "--align", "megatron"],
        [str(SAMPLES / "cnn.safetensors"), "-n", "1"],
    ],
)
def test_inspect_page_numbers_on_other_models(tmp_path, args):
    doc, page = write_page(tmp_path, *args)
    check_numbers(doc, Dom(page.read_text()))


def test_page_is_self_contained(tmp_path):
    _, page = write_page(tmp_path, LLAMA, "-n", "4")
    text = page.read_text()
    dom = Dom(text)
    assert not dom.find("link") and not dom.find("img") and not dom.find("iframe")
    assert all("src" not in e["attrs"] for e in dom.find("script"))
    assert "http://" not in text and "https://" not in text and "url(//" not in text
    hrefs = [e["attrs"]["href"] for e in dom.find("a")]
    assert hrefs and all(h.startswith("#") for h in hrefs)
    assert len(dom.find("script")) == 1 and len(dom.find("style")) == 1


def test_identical_blocks_fold_behind_one_control_and_every_buffer_is_there(tmp_path):
    header = tmp_path / "llama70b.safetensors"
    write_sparse(header)
    report = inspect_model(load_source(str(header)), options(InspectOptions, world_size=256))
    text = inspect_page(report)
    assert len(text.encode()) < 2_000_000  # the product's bar is 2 MB (the 5 MB)
    dom = Dom(text)
    svgs = buffers_of(dom)
    assert len(svgs) == len(report.buffers) == 81
    folded = [s for s in svgs if s["in_details"]]
    assert len(folded) == 79  # model.layers.1 ... model.layers.79 behind one control
    summaries = [e["text"] for e in dom.find("summary")]
    assert "+79 more buffers with this layout: model.layers.1 … model.layers.79" in summaries
    # 256 ranks: every boundary inside a layer buffer cuts a parameter except none
    cut = dom.find("path", class_="cut")
    assert len(cut) == 81 and all(c["attrs"]["d"].count("M") == 255 for c in cut)


def test_html_file_errors_are_one_line_and_write_nothing(tmp_path):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    cases = {
        str(tmp_path): "is a folder",
        str(keep): "exists and is not an .html file",
    }
    for target, message in cases.items():
        result = runner.invoke(app, ["inspect", LLAMA, "--html", target])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
        assert message in result.stderr and "Traceback" not in result.output
    assert keep.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt"
    ]
    page = tmp_path / "model.html"
    page.write_text("<p>not a model</p>")
    result = runner.invoke(app, ["inspect", str(page), "--html", str(page)])
    assert result.exit_code == 2 and "is the input" in result.stderr
    assert page.read_text() == "<p>not a model</p>"


def test_an_existing_page_is_replaced_and_parents_are_made(tmp_path):
    page = tmp_path / "ci" / "artifacts" / "mem.html"
    for _ in range(2):
        result = runner.invoke(app, ["inspect", LLAMA, "--html", str(page)])
        assert result.exit_code == 0, result.output
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in page.parent.iterdir()) == ["mem.html"]


def test_profile_page_draws_both_steps_to_their_peaks(tmp_path):
    page = tmp_path / "profile.html"
    argv = ["profile", "--model", "sample_models.models:mlp", "-n", "2", "--json"]
    result = runner.invoke(app, [*argv, "--html", str(page)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    dom = Dom(page.read_text())
    series = {e["attrs"]["data-variant"]: e["attrs"] for e in dom.find("path", class_="series")}
    assert set(series) == {"original", "converted"}
    for variant in series:
        step = doc[variant]
        assert int(series[variant]["data-peak"]) == step["peak_bytes"]  # the drawn maximum
        assert int(series[variant]["data-reported-peak"]) == step["peak_bytes"]
    totals = [int(t["attrs"]["data-bytes"]) for t in dom.find("div", class_="stack-total")]
    assert totals == [doc["original"]["peak_bytes"], doc["converted"]["peak_bytes"]]


def test_check_page_is_written_when_the_gate_fails(tmp_path):
    from tests.gate.test_check import write_model

    model, base, page = tmp_path / "m.safetensors", tmp_path / "b.json", tmp_path / "c.html"
    write_model(model, layers=2)
    argv = ["check", str(model), "-b", str(base), "-n", "4", "--html", str(page)]
    assert runner.invoke(app, [*argv, "--update"]).exit_code == 0
    assert "new baseline written" in page.read_text()
    write_model(model, layers=3)  # KiB more: past the percent, under the default byte floor
    result = runner.invoke(app, [*argv, "--min-bytes", "0", "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    dom = Dom(page.read_text())
    rows = dom.find("tr", data_metric=True)
    assert [r["attrs"]["data-metric"] for r in rows] == [m["name"] for m in doc["metrics"]]
    assert [r["attrs"]["class"] == "fail" for r in rows] == [m["regressed"] for m in doc["metrics"]]
    values = [int(e["attrs"]["data-value"]) for e in dom.find("td", data_value=True)]
    assert values == [v for m in doc["metrics"] for v in (m["baseline"], m["current"])]
    assert dom.find("p", class_="verdict fail")
    assert len(buffers_of(dom)) == 4  # the current model: three blocks and the root


def test_plan_heatmap_hook_colours_each_cell_by_its_share_of_the_gpu():
    gib = 1024**3
    plan = {
        "gpu_memory_bytes": 80 * gib,
        "cells": [
            {
                "world_size": ws,
                "micro_batch": mb,
                "checkpointing": ck,
                "peak_bytes": peak * gib,
                "share": fit_by_share(peak * gib, 80 * gib).share,
                "level": fit_by_share(peak * gib, 80 * gib).verdict,
            }
            for ws, mb, ck, peak in [
                (8, 1, "none", 90),
                (8, 1, "full", 70),
                (64, 1, "none", 60),
                (64, 1, "full", 20),
            ]
        ],
    }
    dom = Dom(plan_heatmap(plan))
    cells = dom.find("td")
    assert [c["attrs"]["class"] for c in cells] == [
        "cell over",
        "cell tight",
        "cell fits",
        "cell fits",
    ]
    assert [int(c["attrs"]["data-bytes"]) for c in cells] == [
        c["peak_bytes"] for c in plan["cells"]
    ]
    assert [c["text"] for c in cells] == ["90.00 GiB", "70.00 GiB", "60.00 GiB", "20.00 GiB"]
    assert [e["text"] for e in dom.find("th", class_="r")] == ["8 GPUs", "64 GPUs"]
