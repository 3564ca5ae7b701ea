"""Run every benchmark (``benchmarks/bench_*.py``); exit 1 if any bar is missed.

python -m benchmarks.run [--results FILE] [NAME ...]   # e.g. python -m benchmarks.run inspect_70b

Each benchmark's lines, as it prints them, also go to ``benchmarks/RESULTS.md``
(or FILE) under a heading of its own that says when, on what machine and with which
torch it ran. A run of some benchmarks replaces their sections and keeps the others,
so the file always holds the latest run of each. The docs cite that file for figures
instead of quoting them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
FENCE = "````"  # four backticks: a benchmark's own output may hold three
HEADER = """# Benchmark results

Written by `python -m benchmarks.run` (`make bench`); do not edit by hand. Each
section is one benchmark's output as it printed it, under the date, machine and
torch version of the run that wrote it. Running some benchmarks
(`python -m benchmarks.run NAME ...`) replaces their sections and keeps the others.
"""


class _Tee(io.TextIOBase):
    """Writes to the terminal and to a buffer, so a benchmark prints as it goes."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def describe_machine() -> str:
    """CPU model and count, memory, OS and GPU, in one line."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f", {kib / 1024**2:.0f} GiB memory"
    return (
        f"{cpu}, {os.cpu_count()} CPUs{memory}, {platform.system()} {platform.release()}, "
        f"GPU: {describe_gpus()}"
    )


def describe_gpus() -> str:
    """The GPUs ``nvidia-smi`` lists (torch is not imported here: some benchmarks
    measure this process)."""
    if not shutil.which("nvidia-smi"):
        return "none"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        names = [n.strip() for n in done.stdout.splitlines() if n.strip()]
        if done.returncode == 0 and names:
            return f"{len(names)} x {names[0]}"
    return "none"


def describe_run(now: datetime) -> str:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return (
        f"{now:%Y-%m-%d %H:%M} UTC; {describe_machine()}; torch {torch}, "
        f"Python {platform.python_version()}"
    )


def render_section(name: str, ran: str, ok: bool, printed: str) -> str:
    verdict = "all bars met" if ok else "bars missed"
    return (
        f"## {name}\n\n`python -m benchmarks.run {name}`, {verdict}: {ran}\n\n"
        f"{FENCE}text\n{printed.rstrip()}\n{FENCE}\n"
    )


def parse_sections(text: str) -> dict[str, str]:
    """``{benchmark name: its section}`` of a results file (headings inside a
    benchmark's fenced output are not headings)."""
    sections: dict[str, list[str]] = {}
    current, fenced = None, False
    for line in text.splitlines(keepends=True):
        if line.startswith(FENCE):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        if current is not None:
            sections[current].append(line)
    return {name: "".join(lines).rstrip() + "\n" for name, lines in sections.items()}


def write_results(path: Path, new: dict[str, str]) -> None:
    """Replace ``new``'s sections in ``path`` (others kept), in name order, then
    rename into place."""
    sections = parse_sections(path.read_text()) if path.exists() else {}
    sections.update(new)
    body = "\n".join(sections[name] for name in sorted(sections))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{HEADER}\n{body}")
    tmp.replace(path)


def run_benchmark(name: str) -> tuple[bool, str]:
    """Run one benchmark; whether its bars were met, and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        module = importlib.import_module(f"benchmarks.bench_{name}")
        ok = bool(module.main())
    return ok, printed.getvalue()


def main(names: list[str], results: Path = RESULTS) -> int:
    found = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    chosen = names or found
    unknown = [name for name in chosen if name not in found]
    if unknown:
        print(f"no benchmark {unknown[0]!r}; have {', '.join(found)}")
        return 2
    failed = []
    for name in chosen:
        print(f"== {name}")
        ok, printed = run_benchmark(name)
        ran = describe_run(datetime.now(timezone.utc))
        write_results(results, {name: render_section(name, ran, ok, printed)})
        if not ok:
            failed.append(name)
    print("all bars met" if not failed else f"bars missed: {', '.join(failed)}")
    print(f"results: {results}")
    return 1 if failed else 0


def parse_args(argv: list[str]) -> tuple[list[str], Path]:
    if argv[:1] == ["--results"] and len(argv) >= 2:
        return argv[2:], Path(argv[1])
    return argv, RESULTS


if __name__ == "__main__":
    sys.exit(main(*parse_args(sys.argv[1:])))
