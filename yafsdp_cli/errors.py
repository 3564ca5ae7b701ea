"""The project's exceptions.

Every error a user can cause is a ``YafsdpError``: the CLI prints its message as one
line on stderr and exits with code 2. Messages name the offending thing (a key, a
file, a filter), say why it is wrong, and say what to do.
"""

from __future__ import annotations


class YafsdpError(Exception):
    """Base class: bad usage or unusable input (exit code 2)."""


class FilterError(YafsdpError):
    """A --filter/--exclude/--unit expression is malformed or matches nothing."""


class LayoutError(YafsdpError):
    """A flat-buffer layout breaks one of its invariants."""


class SourceError(YafsdpError):
    """A model source cannot be read: missing, corrupt, lying header, refused pickle."""


class CheckpointError(YafsdpError):
    """A flat-buffer checkpoint is inconsistent: checksum, layout or rank set."""


class ConversionError(YafsdpError):
    """A live module cannot be converted or restored."""
