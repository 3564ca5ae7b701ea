"""The Typer app object and its global options."""

from __future__ import annotations

from typing import Annotated

import typer

from .command_kit import State

app = typer.Typer(
    name="yafsdp",
    help="Model memory profiler and flat-buffer (metaparam) converter for PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"yafsdp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    if debug:
        State.debug = True
