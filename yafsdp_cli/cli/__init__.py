"""The ``yafsdp`` command line: thin commands over the library.

Each command parses its options, calls one library function, renders the result
with ``yafsdp_cli.report`` and sets the exit code (0 ok, 1 a check failed, 2 bad
usage or unusable input). Only this package imports Typer and Rich.
"""

from __future__ import annotations

from . import check_cmd, convert_cmd, inspect_cmd, plan_cmd, profile_cmd, verify_cmd  # noqa: F401
from .app import app


def main() -> None:
    """The console script: usage errors become one line on stderr and exit 2."""
    import signal
    import sys

    import typer

    from .common import Terminated, on_sigterm

    signal.signal(signal.SIGTERM, on_sigterm)
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


__all__ = ["app", "main"]
