"""Reading files defensively: JSON documents and byte ranges, errors as project errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import SourceError, YafsdpError

CHUNK_BYTES = 16 * 1024 * 1024


def read_json(path: Path, *, error: type[YafsdpError] = SourceError) -> Any:
    """The JSON document in ``path``; an unreadable or invalid file raises ``error``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None


def read_chunks(
    path: Path,
    offset: int,
    nbytes: int,
    chunk: int = CHUNK_BYTES,
    *,
    error: type[YafsdpError] = SourceError,
    what: str = "early",
) -> Iterator[memoryview]:
    """``nbytes`` bytes of ``path`` from ``offset`` with plain reads into one reused
    buffer; each chunk is valid until the next. A short file raises ``error``."""
    if nbytes <= 0:
        return
    buf = bytearray(min(chunk, nbytes))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while nbytes:
            n = f.readinto(view[: min(nbytes, len(buf))])
            if not n:
                raise error(f"{path}: ended {what} (truncated file)")
            nbytes -= n
            yield view[:n]
