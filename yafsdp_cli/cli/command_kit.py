"""What every command shares: consoles, the error boundary, the exit codes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer

from ..errors import YafsdpError, printable

if TYPE_CHECKING:
    from rich.console import Console

# torch warns at import when numpy is missing; that is noise for a CLI user.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2
# verify: the original did not reproduce its own numbers, so no verdict on the conversion
EXIT_NOT_REPRODUCIBLE = 3
FORMATS = ("table", "json", "markdown")


class LazyConsole:
    """A Rich ``Console`` made on first use, so that a command that renders nothing
    with Rich (``--json``, a copy that shows no bar) does not import Rich at all."""

    def __init__(self, **options):
        self._options = options
        self._console: Console | None = None

    def get(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def print(self, *objects, **options) -> None:
        """The real console's ``print``; plain text (``markup=False``: notes, warnings,
        lines naming files and tensors) has its control characters escaped line by
        line (``errors.printable``), so a name read from a file cannot act on the
        terminal. Markup text is ours and escapes what it quotes itself."""
        if options.get("markup") is False:
            objects = tuple(
                "\n".join(printable(line) for line in o.split("\n")) if isinstance(o, str) else o
                for o in objects
            )
        self.get().print(*objects, **options)

    def __getattr__(self, name: str):  # is_terminal, width...: the real console's
        if name.startswith("_"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.get(), name)


def real_console(console) -> Console:
    """The Rich ``Console`` behind ``console`` (a ``LazyConsole`` or a console)."""
    return console.get() if isinstance(console, LazyConsole) else console


stdout = LazyConsole(highlight=False, soft_wrap=False)
stderr = LazyConsole(stderr=True, highlight=False, soft_wrap=True)


class State:
    debug = bool(os.environ.get("YAFSDP_DEBUG"))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that every ``finally`` (the staged
    output's clean-up) runs, as for Ctrl-C; exit code 128 + 15."""

    code = 143


def on_sigterm(signum, frame) -> None:
    raise Terminated


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print one line on stderr and return the Exit to raise. Control characters
    (a newline, an escape sequence from a name in a file) are escaped, so the line
    is one line and the terminal acts on none of it."""
    stderr.print(f"[bold red]error:[/] {printable(message)}", markup=True, highlight=False)
    return typer.Exit(code)


@contextlib.contextmanager
def errors_to_exit() -> Iterator[None]:
    """Map project errors to exit 2 with one line on stderr; never a traceback
    unless ``--debug`` (or ``YAFSDP_DEBUG=1``) asks for one.

    A signal says what it interrupted: before an output was put in place, nothing
    was written; after, the output is complete (the writer records it as it renames
    it, with signals held, so the two cannot disagree)."""
    before = len(_written())
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except YafsdpError as exc:
        if State.debug:
            traceback.print_exc(file=sys.stderr)
        raise fail(_escape(str(exc))) from None
    except Terminated:
        raise fail(f"terminated (SIGTERM){_outcome(before)}", Terminated.code) from None
    except KeyboardInterrupt:
        raise fail(f"interrupted{_outcome(before)}", 130) from None
    except OSError as exc:  # an input or output no check caught: still one line
        if State.debug:
            traceback.print_exc(file=sys.stderr)
        where = f"{exc.filename}: " if exc.filename else ""
        raise fail(_escape(f"{where}{exc.strerror or exc}")) from None
    except Exception as exc:  # a bug, or an input no check caught: still one line
        if State.debug:
            traceback.print_exc(file=sys.stderr)
        hint = "" if State.debug else " (rerun with --debug for the traceback)"
        raise fail(_escape(f"internal error: {type(exc).__name__}: {exc}{hint}")) from None


def _written() -> list:
    """``fileio.WRITTEN``: the outputs this process put in place. A command that
    never imported ``fileio`` wrote none, and need not import it to say so."""
    fileio = sys.modules.get("yafsdp_cli.fileio")
    return fileio.WRITTEN if fileio is not None else []


def _outcome(before: int) -> str:
    written = _written()[before:]
    if not written:
        return "; no output was written"
    return f" after {_escape(', '.join(map(str, written)))} was written in full"


INTERRUPTED = "error: interrupted; no output was written\n"


@contextlib.contextmanager
def interrupt_ends_at_once() -> Iterator[None]:
    """Around a computation that writes nothing (plan's and profile's steps): Ctrl-C
    ends the command there and then, with one line, exit 130 and child processes
    terminated, instead of raising KeyboardInterrupt wherever the main thread is.

    Why: raised inside a Python callback that torch's C++ runs where no exception can
    pass (such as a storage's weakref finalizer, which the memory tracker keeps, run
    from a destructor), KeyboardInterrupt ends the process in ``std::terminate``
    ("terminate called without an active exception", SIGABRT): seen under load in
    ``test_ctrl_c_ends_a_plan_and_its_workers``. Nothing is being written meanwhile,
    so nothing needs the unwinding that ``errors_to_exit`` gives a write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(_signum, _frame) -> None:
        import multiprocessing
        import multiprocessing.util

        if sys.stderr.isatty():
            sys.stderr.write("\x1b[?25h\n")  # a progress bar's hidden cursor back
        sys.stderr.write(INTERRUPTED)
        sys.stderr.flush()
        for child in multiprocessing.active_children():
            child.terminate()
        # then what multiprocessing's own exit hook does: pools finished, their
        # semaphores unlinked (else its resource tracker warns of leaked ones)
        with contextlib.suppress(Exception):
            multiprocessing.util._exit_function()
        os._exit(130)

    before = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def check_format(fmt: str, json_out: bool) -> str:
    """``--format`` checked; ``--json`` wins."""
    fmt = "json" if json_out else fmt
    if fmt not in FORMATS:
        raise YafsdpError(f"--format {fmt!r} is not one of {' | '.join(FORMATS)}")
    return fmt


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(" ".join(text.split()))
