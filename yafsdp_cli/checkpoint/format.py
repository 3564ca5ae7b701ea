"""The flat-buffer checkpoint format: names, metadata keys, checksums, data order.

A flat checkpoint is an ordinary safetensors file (or one per rank plus an index);
everything yafsdp needs lives in ``__metadata__`` as strings:

=========================== ==================================================
key                         value
=========================== ==================================================
``format``                  ``"pt"`` (as ``safetensors.torch`` writes it)
``yafsdp.format``           ``"flat"`` (one file) or ``"flat-shard"`` (a rank file)
``yafsdp.version``          ``"1"``
``yafsdp.layout``           the layout, JSON (``layout.layout_to_dict``)
``yafsdp.layout_checksum``  checksum of the ``yafsdp.layout`` text (utf-8)
``yafsdp.checksums``        JSON ``{tensor name: checksum}``, every tensor here
``yafsdp.rank``             rank files only: this file's rank
``yafsdp.shards``           rank files only: how many rank files the set has
``yafsdp.source``           file name of the source (information only)
``yafsdp.source_metadata``  JSON of the source's own ``__metadata__``
``yafsdp.optimizer``        version 2 only: the optimizer record (``optim_state.py``);
                            its state buffers ``BUFFER@FIELD`` are tensors beside
                            the buffers, split into the same shards
=========================== ==================================================

A weights-only checkpoint is written as version 1, byte for byte what a reader of
version 1 expects; version 2 adds the optimizer record and its state buffers.

A sharded set is a folder holding ``rank-RRRRR-of-NNNNN.safetensors`` and
``yafsdp.index.json`` (``IndexDoc`` below).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.layout import Layout, layout_from_dict, layout_to_dict
from ..errors import CheckpointError
from .crc import crc32, crc32_combine, crc32_zeros

FORMAT_VERSION = 1
STATE_VERSION = 2  # the version of a checkpoint that carries optimizer state
READ_VERSIONS = (FORMAT_VERSION, STATE_VERSION)
KIND_FLAT = "flat"
KIND_SHARD = "flat-shard"
INDEX_NAME = "yafsdp.index.json"
INDEX_FORMAT = "yafsdp.flat-sharded"

KEY_FORMAT = "yafsdp.format"
KEY_VERSION = "yafsdp.version"
KEY_LAYOUT = "yafsdp.layout"
KEY_LAYOUT_SUM = "yafsdp.layout_checksum"
KEY_CHECKSUMS = "yafsdp.checksums"
KEY_RANK = "yafsdp.rank"
KEY_SHARDS = "yafsdp.shards"
KEY_SOURCE = "yafsdp.source"
KEY_SOURCE_META = "yafsdp.source_metadata"
KEY_OPTIM = "yafsdp.optimizer"
YAFSDP_KEYS = (
    KEY_FORMAT,
    KEY_VERSION,
    KEY_LAYOUT,
    KEY_LAYOUT_SUM,
    KEY_CHECKSUMS,
    KEY_RANK,
    KEY_SHARDS,
    KEY_SOURCE,
    KEY_SOURCE_META,
    KEY_OPTIM,
)

# Checksum: CRC-32 (zlib), written as "crc32:%08x". Throughput on an AMD EPYC with
# SHA-NI and AVX-512, 16 MiB chunks of random data, Python 3.11:
#   crc32 4.07 GB/s, adler32 3.54, sha1 1.90, sha256 1.78, md5 0.75, blake2b 0.76,
#   sha512 0.71, blake2s 0.43, sha3_256 0.42
# The checksum guards against corruption (a flipped byte, a truncated copy, a file
# from another conversion), not against an attacker, who could rewrite any unkeyed
# digest in the same header; CRC-32 detects every error burst up to 32 bits and
# misses a random corruption with probability 2**-32, at 2.3x sha256's speed,
# which matters on a path whose bar is 2x a plain copy. Readers also accept
# "sha256:" so the algorithm can change without a new format version. The same
# CRC-32 is computed by isal when installed (crc.py: 30 GB/s against zlib's 4.9),
# so files and their checksums do not depend on it.
CHECKSUM_ALGO = "crc32"

# Bytes per step for byte streams that have no file behind them (a .pt state dict's
# tensors, the --verify comparison); file ranges go through file_ranges.Copier, whose
# measured best step is larger (4 MiB, benchmarks/bench_copy_methods.py). 128 KiB
# keeps a chunk in L2 between read, checksum and write (0.9-1.1 s for the 1.24 GiB
# benchmark file, against 1.8-4.2 s with 16 MiB, median of 3).
STREAM_CHUNK = 128 * 1024


class Checksum:
    """A running checksum over a stream of byte chunks."""

    def __init__(self, algo: str = CHECKSUM_ALGO):
        if algo not in ("crc32", "sha256"):
            raise CheckpointError(f"unknown checksum algorithm {algo!r}; known: crc32, sha256")
        self.algo = algo
        self._crc = 0
        self._sha = None
        if algo == "sha256":  # read only, never written: hashlib (OpenSSL) loads here
            import hashlib

            self._sha = hashlib.sha256()

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = crc32(data, self._crc)

    def extend(self, piece_crc: int, n: int) -> None:
        """Append a piece of ``n`` bytes whose CRC-32 is known (CRC-32 only: what
        yafsdp writes; sha256 is only ever read)."""
        if self._sha is not None:
            raise CheckpointError("a sha256 checksum cannot be extended by a CRC-32")
        self._crc = crc32_combine(self._crc, piece_crc, n)

    def update_zeros(self, n: int) -> None:
        """As ``update(bytes(n))``, without the bytes for CRC-32."""
        if self._sha is None:
            self._crc = crc32_zeros(self._crc, n)
            return
        block = bytes(min(n, STREAM_CHUNK))
        while n > 0:
            self._sha.update(block[: min(n, len(block))])
            n -= len(block)

    def text(self) -> str:
        digest = self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"
        return f"{self.algo}:{digest}"


def placeholder(algo: str = CHECKSUM_ALGO) -> str:
    """A checksum-shaped string of the same width, patched in after the data."""
    return f"{algo}:" + "0" * len(Checksum(algo).text().split(":", 1)[1])


def checksum_of(data: bytes, algo: str = CHECKSUM_ALGO) -> str:
    c = Checksum(algo)
    c.update(data)
    return c.text()


def algo_of(text: str) -> str:
    algo, sep, digest = text.partition(":")
    if not sep or algo not in ("crc32", "sha256") or not digest:
        raise CheckpointError(f"checksum {text!r} is not 'crc32:HEX' or 'sha256:HEX'")
    return algo


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor of a file to write: ``data[begin:end]`` once laid out."""

    name: str
    dtype: str  # canonical dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * dtypes.itemsize(self.dtype)


def data_order(slots: Sequence[TensorSlot]) -> list[TensorSlot]:
    """Larger itemsizes first (stable), so that every tensor starts at a multiple
    of its own itemsize (the header is padded to 8 bytes), as safetensors does."""
    return sorted(slots, key=lambda s: -dtypes.itemsize(s.dtype))


def layout_text(layout: Layout) -> str:
    """The canonical JSON text of a layout (compact; key order as ``asdict``)."""
    return json.dumps(layout_to_dict(layout), separators=(",", ":"))


def rank_file_name(rank: int, shards: int) -> str:
    return f"rank-{rank:05d}-of-{shards:05d}.safetensors"


def parse_layout(text: str, where: str, expected_sum: str | None) -> Layout:
    """The layout in ``text``, checked against its checksum and its invariants."""
    if expected_sum is not None:
        got = checksum_of(text.encode(), algo_of(expected_sum))
        if got != expected_sum:
            raise CheckpointError(
                f"{where}: the layout metadata does not match its checksum "
                f"(stored {expected_sum}, computed {got}); the metadata was modified"
            )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: the layout metadata is not JSON ({exc})") from None
    try:
        return layout_from_dict(data)
    except Exception as exc:  # LayoutError, or a dtype the table does not know
        raise CheckpointError(f"{where}: {exc}") from None


def json_field(metadata: dict[str, str], key: str, where: str, kind: type):
    """``json.loads(metadata[key])``, which must be a ``kind``; a clear error if not."""
    if key not in metadata:
        raise CheckpointError(f"{where}: metadata has no {key!r}; not a yafsdp flat checkpoint?")
    try:
        value = json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: metadata {key!r} is not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise CheckpointError(f"{where}: metadata {key!r} is not a JSON {kind.__name__}")
    return value


def int_field(metadata: dict[str, str], key: str, where: str) -> int:
    text = metadata.get(key, "")
    if not text.isdigit():
        raise CheckpointError(f"{where}: metadata {key!r} is {text!r}, not a whole number")
    return int(text)
