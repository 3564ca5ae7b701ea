"""Progress bars for long runs: on stderr only, never under --json, never when stderr
is not a terminal, and only for work that lasts over a second.

- ``ProgressBar``: byte counts (convert, restore, reshard), fed per 128 KiB chunk;
- ``StageBar``: named stages of a run (profile), fed as each stage starts;
- ``WaitBar``: work we cannot see into (verify on N spawned ranks): a pulsing bar
  and the elapsed time.
"""

from __future__ import annotations

import threading
import time

from .command_kit import real_console, stderr


class ProgressBar:
    """A transient Rich bar of bytes done per phase; updated from the caller's
    thread only (no refresh thread taking the GIL from a copy loop)."""

    DELAY_S = 1.0

    def __init__(self, enabled: bool, console=None):
        self.console = console or stderr
        self.enabled = enabled and self.console.is_terminal
        self.start = time.monotonic()
        self.bar = None
        self.tasks: dict[str, int] = {}
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()  # called per 128 KiB chunk: update ~20 times a second
        if now - self.start < self.DELAY_S or (now - self.last < 0.05 and done < total):
            return
        self.last = now
        if self.bar is None:
            from rich.progress import DownloadColumn, Progress, TimeRemainingColumn

            columns = (*Progress.get_default_columns()[:2], DownloadColumn(binary_units=True))
            self.bar = Progress(
                *columns,
                TimeRemainingColumn(),
                console=real_console(self.console),
                transient=True,
                auto_refresh=False,  # no refresh thread taking the GIL; we refresh below
            )
            self.bar.start()
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total, refresh=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


class StageBar:
    """One transient task whose description is the current stage; it appears
    ``DELAY_S`` after the start (a refresh thread keeps the elapsed time moving
    while a stage runs, which is when nothing calls us)."""

    DELAY_S = 1.0

    def __init__(self, enabled: bool, title: str, *, total: int | None = None, console=None):
        self.console = console or stderr
        self.enabled = enabled and self.console.is_terminal
        self.title, self.total = title, total
        self.stage, self.done = "", 0
        self.bar = None
        self.task = None
        self.closed = False
        self.lock = threading.Lock()
        self.timer = threading.Timer(self.DELAY_S, self._show)
        self.timer.daemon = True

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            self.stage, self.done, self.total = stage, done, total
            if self.bar is not None:
                self.bar.update(self.task, description=self._text(), completed=done, total=total)

    def _text(self) -> str:
        return f"{self.title}: {self.stage}" if self.stage else self.title

    def _show(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        with self.lock:
            if self.closed:
                return
            columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
            if self.total is not None:
                columns.append(MofNCompleteColumn())
            self.bar = Progress(
                *columns,
                TimeElapsedColumn(),
                console=real_console(self.console),
                transient=True,
                refresh_per_second=4,
            )
            self.task = self.bar.add_task(self._text(), total=self.total, completed=self.done)
            self.bar.start()

    def __enter__(self) -> StageBar:
        if self.enabled and self.DELAY_S <= 0:
            self._show()
        elif self.enabled:
            self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        with self.lock:
            self.closed = True
            if self.bar is not None:
                self.bar.stop()
                self.bar = None


def WaitBar(enabled: bool, title: str, console=None) -> StageBar:  # noqa: N802
    """A pulsing bar with the elapsed time, for work that reports no progress."""
    return StageBar(enabled, title, console=console)
