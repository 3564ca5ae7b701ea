"""The ``yafsdp`` command line: thin commands over the library.

Each command parses its options, calls one library function, renders the result
with ``yafsdp_cli.report`` and sets the exit code (0 ok, 1 a check failed, 2 bad
usage or unusable input). Only this package imports Typer and Rich.

Start-up is part of every command's time (a copy of a 1.2 GiB checkpoint takes
about a third of a second), so nothing is imported before it is needed: a command
registers itself on ``root.app`` when its module is imported, ``main`` imports only
the module of the command it runs (all of them for ``--help`` or an unknown name),
each command imports its library inside its function, and Rich is imported when
something is rendered (never under ``--json``). ``app`` from this package has every
command.

Modules: ``root`` (the app), one ``*_cmd`` per command (no command module imports
another), ``command_kit`` (consoles, the error boundary, exit codes), ``flags``
(every option shared by several commands, declared once, and what builds the
library's options model from them), ``progress`` and ``html_out``. It may import
every room.
"""

from __future__ import annotations

# The module that registers each command, in the order ``yafsdp --help`` lists them.
# in the README's order, which is the order ``--help`` lists them in (Typer lists
# commands as they register, and they register as their modules are imported)
COMMAND_MODULES = {
    "plan": "plan_cmd",
    "calibrate": "calibrate_cmd",
    "inspect": "inspect_cmd",
    "convert": "convert_cmd",
    "restore": "convert_cmd",
    "reshard": "convert_cmd",
    "verify": "verify_cmd",
    "profile": "profile_cmd",
    "check": "check_cmd",
}
_ROOT_FLAGS = ("--debug",)  # root options that may come before the command name


def load_commands(command: str | None = None):
    """The Typer app with ``command``'s module imported (every module if ``None``
    or not a command name)."""
    import importlib

    from .root import app

    if command in COMMAND_MODULES:
        modules = [COMMAND_MODULES[command]]
    else:
        modules = list(dict.fromkeys(COMMAND_MODULES.values()))
    for module in modules:
        importlib.import_module(f"{__name__}.{module}")
    return app


def command_of(argv: list[str]) -> str | None:
    """The command name ``argv`` runs, or ``None`` when it asks for more than one
    command (``--help`` before any name, no name, an unknown name)."""
    for arg in argv:
        if arg in _ROOT_FLAGS:
            continue
        return arg if arg in COMMAND_MODULES else None
    return None


def __getattr__(name: str):
    if name == "app":
        return load_commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """The console script: usage errors become one line on stderr and exit 2."""
    import signal
    import sys

    import typer

    from .command_kit import Terminated, on_sigterm

    signal.signal(signal.SIGTERM, on_sigterm)
    app = load_commands(command_of(sys.argv[1:]))
    try:
        code = app(standalone_mode=False)
    except Terminated:  # outside a command's error boundary
        sys.stderr.write("error: terminated (SIGTERM)\n")
        code = Terminated.code
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("error: interrupted\n")
        code = 130
    except typer.TyperException as exc:  # Typer's (vendored click's) usage errors
        if not hasattr(exc, "format_message"):
            raise
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "yafsdp"
        message = exc.format_message()
        if message:  # empty when the help was shown for a bare `yafsdp`
            sys.stderr.write(f"error: {message} (see '{where} --help')\n")
        code = getattr(exc, "exit_code", 2)
    sys.exit(code if isinstance(code, int) else 0)


def console() -> None:
    """The installed ``yafsdp`` script: ``main``, then out without the interpreter's
    teardown where nothing is left for it to do.

    Tearing down the modules a command imported takes about 10 ms, 3% of the time
    ``cp`` takes over the 1.24 GiB file that ``python -m benchmarks.run convert``
    copies. A command that imported no torch and left no other thread has nothing to
    finalize but its output streams and ``atexit`` handlers, so those run and the
    process exits at once. ``main`` itself raises ``SystemExit`` as usual, for callers
    that run it in their own interpreter."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    _leave(0 if code is None else code)


def _leave(code) -> None:
    import atexit
    import os
    import sys
    import threading

    if not isinstance(code, int) or "torch" in sys.modules or threading.active_count() > 1:
        sys.exit(code)  # torch's native state and live threads get the full teardown
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)  # a closed pipe is reported the way Python always reports it
    atexit._run_exitfuncs()
    os._exit(code)


__all__ = ["COMMAND_MODULES", "app", "console", "load_commands", "main"]
