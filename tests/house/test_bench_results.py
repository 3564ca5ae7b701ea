"""``python -m benchmarks.run`` writes benchmarks/RESULTS.md from its own run: a
section per benchmark with the date, machine and torch version, and the lines the
benchmark printed; a later run of other benchmarks keeps the earlier sections."""

from __future__ import annotations

import sys
import types
from datetime import datetime, timezone

from conftest import ROOT

from benchmarks import run


def fake_benchmark(monkeypatch, name: str, lines: list[str], ok: bool = True) -> None:
    def main() -> bool:
        for line in lines:
            print(line)
        return ok

    module = types.ModuleType(f"benchmarks.bench_{name}")
    module.main = main
    monkeypatch.setitem(sys.modules, module.__name__, module)


def test_a_run_writes_its_printed_lines_under_a_dated_header(monkeypatch, tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    printed = ["  persistent   1.000 x  bar 1.010 x  PASS", "## not a heading"]
    fake_benchmark(monkeypatch, "fsdp2", printed)
    assert run.main(["fsdp2"], results=results) == 0
    assert "persistent   1.000 x" in capsys.readouterr().out  # still printed as it goes
    text = results.read_text()
    assert text.startswith("# Benchmark results\n")
    sections = run.parse_sections(text)
    assert list(sections) == ["fsdp2"]
    section = sections["fsdp2"]
    assert "`python -m benchmarks.run fsdp2`, all bars met:" in section
    assert f"{datetime.now(timezone.utc):%Y-%m-%d}" in section and "UTC" in section
    assert "CPUs" in section and "torch " in section and "GPU: " in section
    assert "  persistent   1.000 x  bar 1.010 x  PASS\n## not a heading\n" in section


def test_a_later_run_replaces_its_own_section_and_keeps_the_others(monkeypatch, tmp_path):
    results = tmp_path / "RESULTS.md"
    fake_benchmark(monkeypatch, "plan", ["  first"])
    fake_benchmark(monkeypatch, "dcp", ["  dcp line"])
    assert run.main(["plan", "dcp"], results=results) == 0
    fake_benchmark(monkeypatch, "plan", ["  second"], ok=False)
    assert run.main(["plan"], results=results) == 1
    sections = run.parse_sections(results.read_text())
    assert list(sections) == ["dcp", "plan"]
    assert "dcp line" in sections["dcp"]
    assert "second" in sections["plan"] and "first" not in sections["plan"]
    assert "bars missed" in sections["plan"]


def test_an_unknown_name_writes_nothing(tmp_path):
    results = tmp_path / "RESULTS.md"
    assert run.main(["no_such_benchmark"], results=results) == 2
    assert not results.exists()


def test_the_committed_results_file_reads_back():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = run.parse_sections(text)
    names = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert sections and set(sections) <= names
    for section in sections.values():
        assert "`python -m benchmarks.run " in section
