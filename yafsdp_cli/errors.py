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


def printable(text: str) -> str:
    """``text`` (a name read from a file) safe to print on a terminal: each character
    that is not printable (escape sequences, other control characters, bidirectional
    overrides, lone surrogates) written as ``repr`` writes it (``\\x1b``, ``\\u202e``),
    so a file cannot clear the screen, retitle the window or hide text in a message."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cut(text: str, limit: int = 200) -> str:
    """``text`` from a file for a message, unquoted: at most ``limit`` characters of
    it, control characters escaped (``printable``)."""
    return printable(text[:limit]) + ("..." if len(text) > limit else "")


# Python converts an int of at most 4300 digits to text (``sys.int_info``); its
# digits are quoted up to there, cut like any other text
_INT_BITS = 14_000


def excerpt(value: object, limit: int = 80) -> str:
    """At most ``limit`` characters of ``value``'s ``repr``, for a message about a
    value read from a file. Built piece by piece and stopped at the limit, so a
    value nested thousands deep, or a list holding one list many times (a few
    bytes of pickle, billions of elements when written out), costs no more than
    the excerpt. Lists, tuples, dicts and objects' attributes are walked; any
    other value is ``repr``'d only when small (strings and numbers are cut)."""
    out: list[str] = []
    room = [limit + 1]

    def put(text: str) -> None:
        out.append(text[: room[0]])
        room[0] -= len(text)
        if room[0] <= 0:
            raise _FullError

    def walk(v: object, depth: int) -> None:
        if isinstance(v, (set, frozenset)):
            v = list(v)  # hashed when built, so walked as a list
        if isinstance(v, (list, tuple, dict)) or hasattr(v, "__dict__"):
            if depth > 8:
                put("...")
                return
            if isinstance(v, dict) or not isinstance(v, (list, tuple)):
                items = v.items() if isinstance(v, dict) else vars(v).items()
                put("{" if isinstance(v, dict) else f"{type(v).__name__}(")
                for i, (k, x) in enumerate(items):
                    put(", " if i else "")
                    if isinstance(v, dict):
                        walk(k, depth + 1)
                        put(": ")
                    else:
                        put(f"{k}=")
                    walk(x, depth + 1)
                put("}" if isinstance(v, dict) else ")")
                return
            put("[" if isinstance(v, list) else "(")
            for i, x in enumerate(v):
                put(", " if i else "")
                walk(x, depth + 1)
            put("]" if isinstance(v, list) else ("," if len(v) == 1 else "") + ")")
        elif isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > _INT_BITS:
            put(f"<a {v.bit_length()}-bit number>")  # Python refuses to str() it
        elif isinstance(v, (str, bytes, bytearray)):
            put(printable(repr(v[: limit + 1])))
        else:
            put(printable(repr(v))[: limit + 1])

    try:
        walk(value, 0)
    except _FullError:
        return "".join(out)[: limit - 3] + "..."
    except RecursionError:  # a __dict__ that holds itself through other objects
        return "".join(out)[: limit - 3] + "..."
    return "".join(out)


class _FullError(Exception):
    """The excerpt reached its limit."""
