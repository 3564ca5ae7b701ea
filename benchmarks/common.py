"""Measuring commands: wall time and peak RSS of a child process, and the floors."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"  # generated inputs; git-ignored
PYTHON = sys.executable
YAFSDP = str(Path(PYTHON).with_name("yafsdp"))


@dataclass(frozen=True)
class Run:
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    stdout: bytes
    cpu_s: float = 0.0  # the command's user + system CPU time (wait4), load-proof-ish


# Linux folds the pre-exec image of a forked child into its peak RSS (at exec the
# old mm's high-water mark is kept), so a child forked straight from this Python
# process would report at least this process's own peak. A tiny wrapper (python -S,
# about 10 MB) forks and execs the command and reports the command's own wait4
# ru_maxrss; the import floor is measured the same way.
_WRAPPER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(argv: list[str], *, env: dict | None = None, stdout_to: Path | None = None) -> Run:
    """Run ``argv`` once; its wall time and peak RSS (the command's own ``ru_maxrss``)."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r") as rss,
    ):
        wrapped = [PYTHON, "-S", "-c", _WRAPPER, rss.name, *argv]
        start = time.perf_counter()
        code = subprocess.call(wrapped, stdout=out, stderr=err, env=env)
        wall = time.perf_counter() - start
        out.seek(0)
        data = out.read()
        if code != 0:
            err.seek(0)
            sys.stderr.write(err.read().decode(errors="replace"))
        peak_kib, cpu = (rss.read() or "0 0").split()
    if stdout_to:
        stdout_to.write_bytes(data)
    return Run(wall, int(peak_kib) * 1024, code, data, float(cpu))


def compile_package() -> None:
    """Compile yafsdp_cli's bytecode, as installing a package does. Where
    ``PYTHONDONTWRITEBYTECODE`` is set a run never
    writes its .pyc files, so without this every timed command would compile the
    package's sources again: about 20 ms of each start-up, which no installed copy
    pays."""
    import compileall

    compileall.compile_dir(ROOT / "yafsdp_cli", quiet=1)


def median_run(argv: list[str], repeat: int = 5, **kw) -> Run:
    """Median wall time and median peak RSS of ``repeat`` runs (after one warm-up)."""
    measure(argv, **kw)
    runs = [measure(argv, **kw) for _ in range(repeat)]
    return Run(
        statistics.median(r.wall_s for r in runs),
        int(statistics.median(r.peak_rss_bytes for r in runs)),
        max(r.returncode for r in runs),
        runs[-1].stdout,
    )


def import_floor(repeat: int = 5) -> Run:
    """The floor every command is compared to: ``python -c "import torch"``."""
    return median_run([PYTHON, "-W", "ignore", "-c", "import torch"], repeat)


def verdict(name: str, measured: float, bar: float, unit: str) -> bool:
    ok = measured <= bar
    mark = "PASS" if ok else "FAIL"
    print(f"  {name:<28} {measured:10.3f} {unit:<3} bar {bar:10.3f} {unit:<3} {mark}")
    return ok


MiB = 1024 * 1024


class TreeRss:
    """The highest sum of resident memory over this process's descendants, sampled
    every ``interval`` seconds while in the ``with`` block: what a command that runs
    worker processes holds at once (``ru_maxrss`` gives the largest single one)."""

    def __init__(self, interval: float = 0.1):
        import threading

        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import os

        me = os.getpid()
        while not self._stop.wait(self.interval):
            parents: dict[int, int] = {}
            rss: dict[int, int] = {}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    status = (entry / "status").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(fields[1])
                for line in status.splitlines():
                    if line.startswith("VmRSS:"):
                        rss[int(entry.name)] = int(line.split()[1]) * 1024
            total = sum(size for pid, size in rss.items() if _descends(pid, me, parents))
            self.peak = max(self.peak, total)


def _descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    seen = 0
    while pid in parents and seen < 64:
        pid, seen = parents[pid], seen + 1
        if pid == ancestor:
            return True
    return False
