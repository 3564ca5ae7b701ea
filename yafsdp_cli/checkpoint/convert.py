"""``convert_checkpoint``: a model source to a flat-buffer checkpoint, streamed.

Each flat buffer is assembled from its entries' source bytes, in order: for a
safetensors source, and for a DCP folder's tensors and optimizer state, each entry
is one or more ranges of the source files (neighbours merged into one range,
``copy.coalesce``), copied file to file and checksummed in one pass
(``file_ranges.Copier``; torch is not even imported); other sources stream their bytes
(``loaded.reader.iter_bytes``). The model is never held in memory. A reader that
hands out ranges of bytes it can check (DCP's chunks carry a CRC-32 each) checks
them after the copy against the CRCs the copier read back (``check_copied``).

A training checkpoint's optimizer state (``sources.train_state``) is checked whole
against the layout first, then written as state buffers (``optim_state.py``) beside
the weights; ``weights_only`` leaves it out (a version 1 checkpoint, as before).

What the layout is asked is the options model's ``LayoutOptions`` whole (filters,
excludes, units, world size, alignment), as ``plan`` and ``verify`` take it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import dtypes
from ..engine.layout import BufferLayout, Layout
from ..engine.plan import plan
from ..errors import CheckpointError, SourceError
from ..options import LayoutOptions
from ..sources import LoadedModel, load_source
from .file_ranges import Copier, FileRange
from .flat_writer import stored_kept, write_flat, zeros
from .format import KEY_FORMAT, STREAM_CHUNK
from .optim_state import SEP, optim_from
from .reader import open_flat
from .results import ConvertResult, Progress, RoundTrip
from .writer import check_flat_name, check_output, page_phase, staged_output

# (loaded, selection) -> (passed, or None when not run; what happened); the selection
# is the convert's layout options for one process (world size 1)
ModelCheck = Callable[[LoadedModel, LayoutOptions], tuple[bool | None, str]]


def convert_checkpoint(
    source: str | Path | None,
    out: str | Path,
    layout: LayoutOptions | None = None,
    *,
    model: str | None = None,
    trust_pickle: bool = False,
    sharded: bool = False,
    force: bool = False,
    verify: bool = False,
    model_check: ModelCheck | None = None,
    progress: Progress | None = None,
    weights_only: bool = False,
    writer_threads: int | None = None,
) -> ConvertResult:
    """Load ``source`` (and/or ``--model``), plan its layout as ``layout`` asks
    (``LayoutOptions()``: every floating parameter, one rank) and write the checkpoint.
    ``writer_threads``: how many threads write a sharded set's rank files side by side
    (``flat_writer.write_flat``; None: the machine's choice, 1: one file at a time).

    >>> from yafsdp_cli.checkpoint import convert_checkpoint
    >>> from yafsdp_cli.options import LayoutOptions
    >>> r = convert_checkpoint("sample_models/mlp.safetensors", "/tmp/mlp.flat.safetensors",
    ...                        LayoutOptions(world_size=2), force=True)  # doctest: +SKIP
    >>> r.checkpoint.buffers[0].name  # doctest: +SKIP
    '__flat__.float32'
    """
    options = LayoutOptions() if layout is None else layout
    loaded = load_source(source, model=model, trust_pickle=trust_pickle)
    refuse_flat_source(loaded)
    planned = plan(
        loaded.spec,
        options,
    )
    return write_converted(
        loaded,
        planned,
        Path(out),
        sharded=sharded,
        force=force,
        verify=verify,
        model_check=model_check,
        progress=progress,
        selection=options,
        weights_only=weights_only,
        writer_threads=writer_threads,
    )


def refuse_flat_source(loaded: LoadedModel) -> None:
    if KEY_FORMAT in loaded.spec.metadata:
        raise CheckpointError(
            f"{loaded.spec.source} is already a flat-buffer checkpoint; use `yafsdp reshard` "
            "to split it for another world size, or `yafsdp restore` for the state dict"
        )


def write_converted(
    loaded: LoadedModel,
    layout: Layout,
    out: Path,
    *,
    sharded: bool = False,
    force: bool = False,
    verify: bool = False,
    model_check: ModelCheck | None = None,
    progress: Progress | None = None,
    selection: LayoutOptions | None = None,
    weights_only: bool = False,
    writer_threads: int | None = None,
) -> ConvertResult:
    """Stream ``loaded``'s weights into ``layout``'s checkpoint at ``out``.

    With ``verify`` the written file is read back and compared with the source;
    ``model_check`` (``yafsdp_cli.verify.model_check`` from the CLI) then runs the
    forward/backward check in one process on ``selection``, the layout options
    ``layout`` was planned from (filters, excludes, units, align). A failed check
    leaves nothing written."""
    check_flat_name(out, sharded=sharded)
    loaded = with_weights(loaded)
    check_output(out, inputs=input_files(loaded), force=force, folder=sharded)
    training = None if weights_only else _training_state(loaded)
    optim = optim_from(training, layout) if training is not None else None
    reads = _Reads(loaded, training, optim.state_buffers(layout) if optim else ())
    name = Path(loaded.spec.source).name if loaded.path else loaded.spec.source
    copier = Copier(record=True)  # a kept tensor copied to N ranks is read once
    with staged_output(out, folder=sharded, force=force) as staged:
        info = write_flat(
            staged.temp,
            layout,
            sharded=sharded,
            buffer_bytes=reads.buffer,
            kept_bytes=lambda t: reads.pieces(t, t.nbytes),
            source=name,
            source_metadata=loaded.spec.metadata,
            progress=progress,
            final=out,
            copier=copier,
            optim=optim,
            page_phase=page_phase(input_files(loaded)),
            ranged=reads.ranged(layout, optim),
            writer_threads=writer_threads,
        )
        reads.check_copied(copier)
        bytes_read = reads.total
        check = (
            round_trip(loaded, layout, staged.temp, progress, selection, model_check)
            if verify
            else None
        )
        staged.keep = check is None or check.ok
    return ConvertResult(
        source=loaded.spec.source,
        source_kind=loaded.spec.source_kind,
        written=staged.keep,
        checkpoint=info,
        converted=sum(len(b.entries) for b in layout.buffers),
        converted_numel=layout.converted_numel,
        bytes_read=bytes_read,
        notes=tuple(loaded.spec.notes),
        verify=check,
    )


def _training_state(loaded: LoadedModel):
    """The source's optimizer state and other entries (``sources.train_state``), or
    None: DCP folders, torch files and Trainer folders hold some. Asking imports
    torch only for a source that holds torch objects (a ``.pt`` file, a Trainer's
    ``optimizer.pt``), so safetensors and DCP converts stay torch-free."""
    from ..sources.train_state import read_training_state

    return read_training_state(loaded)


def with_weights(loaded: LoadedModel) -> LoadedModel:
    """A source with a reader: ``--model`` alone is built for real (seeded)."""
    if loaded.reader is not None:
        return loaded
    from ..sources.torch_file import TensorDictReader, module_tensors

    module = loaded.build_module()
    spec = dataclasses.replace(
        loaded.spec,
        notes=(*loaded.spec.notes, "no weights given: the factory's own initialization (seed 0)"),
    )
    return dataclasses.replace(loaded, spec=spec, reader=TensorDictReader(module_tensors(module)))


def input_files(loaded: LoadedModel) -> list[Path]:
    files = loaded.reader.files() if loaded.reader is not None else []
    if loaded.path is not None:
        files.append(loaded.path)
    return files


@dataclass
class _Reads:
    """The source's bytes for layout entries and kept tensors, counted."""

    loaded: LoadedModel
    training: Any = None  # sources.train_state.TrainingState
    state_buffers: tuple[BufferLayout, ...] = ()
    total: int = 0

    def __post_init__(self):
        self._state_keys = {}  # (entry name, field) -> the training state reader's key
        if self.training is not None:
            owner = {n: e.name for b in self.state_buffers for e in b.entries for n in e.names}
            for t in self.training.tensors:
                self._state_keys[(owner.get(t.param, t.param), t.field)] = t.key
        self._state_names = {b.name for b in self.state_buffers}

    def _stored(self, record, nbytes: int) -> str:
        stored = self.loaded.stored_name(record)
        have = self.loaded.reader.nbytes(stored)
        if have != nbytes:
            raise SourceError(
                f"{self.loaded.spec.source}: {stored!r} holds {have} bytes, but the layout "
                f"needs {nbytes} for it"
            )
        return stored

    def pieces(self, record, nbytes: int) -> Iterator:
        """The tensor as file ranges where the reader knows them, else its bytes."""
        stored = self._stored(record, nbytes)
        ranges = self.loaded.reader.file_ranges(stored)
        if ranges is None:
            yield from self.tensor(record, nbytes)
            return
        yield from self._copied(ranges)

    def _copied(self, ranges: list) -> Iterator[FileRange]:
        for path, offset, n in ranges:
            self.total += n
            yield FileRange(Path(path), offset, n)

    def ranged(self, layout: Layout, optim) -> bool:
        """Whether every tensor the layout reads lies in the source's files as ranges
        (so the writer may copy them in any order; streamed bytes must be read in
        order)."""
        records = [e for b in layout.buffers for e in b.entries] + list(stored_kept(layout))
        if any(self.loaded.reader.file_ranges(self.loaded.stored_name(r)) is None for r in records):
            return False
        return optim is None or all(
            self.training.reader.file_ranges(t.key) is not None for t in self.training.tensors
        )

    def check_copied(self, copier: Copier) -> None:
        """Readers that handed out ranges they can check (``check_copied``) check them
        against the CRC-32s ``copier`` read back while copying."""
        readers = [self.loaded.reader, getattr(self.training, "reader", None)]
        for reader in readers:
            if reader is not None:
                reader.check_copied(
                    lambda path, offset, n: copier.crc_of_copied(FileRange(path, offset, n))
                )

    def tensor(self, record, nbytes: int) -> Iterator[memoryview]:
        """The tensor's bytes, in chunks (each valid until the next)."""
        stored = self._stored(record, nbytes)
        seen = 0
        for chunk in self.loaded.reader.iter_bytes(stored, STREAM_CHUNK):
            seen += len(chunk)
            yield chunk
        if seen != nbytes:
            raise SourceError(f"{self.loaded.spec.source}: {stored!r} ended after {seen} bytes")
        self.total += nbytes

    def state(self, e, field: str, nbytes: int) -> Iterator:
        """One entry's state ``field`` (zeros where the optimizer keeps none)."""
        key = self._state_keys.get((e.name, field))
        if key is None:
            yield from zeros(nbytes)
            return
        ranges = self.training.reader.file_ranges(key)
        if ranges is not None:
            have = sum(n for _, _, n in ranges)
            if have != nbytes:
                raise SourceError(
                    f"{self.training.where}: {key!r} holds {have} bytes, not {nbytes}"
                )
            yield from self._copied(ranges)
            return
        seen = 0
        for chunk in self.training.reader.iter_bytes(key, STREAM_CHUNK):
            seen += len(chunk)
            yield chunk
        if seen != nbytes:
            raise SourceError(f"{self.training.where}: {key!r} holds {seen} bytes, not {nbytes}")
        self.total += nbytes

    def buffer(self, b: BufferLayout) -> Iterator[memoryview]:
        """The whole logical buffer: entries in flat order, zeros between and after."""
        isz = dtypes.itemsize(b.dtype)
        field = b.name.rpartition(SEP)[2] if b.name in self._state_names else None
        pos = 0
        for e in b.entries:
            yield from zeros((e.offset - pos) * isz)
            if field is None:
                yield from self.pieces(e, e.numel * isz)
            else:
                yield from self.state(e, field, e.numel * isz)
            pos = e.offset + e.numel
        yield from zeros((b.padded_numel - pos) * isz)


def round_trip(
    loaded: LoadedModel,
    layout: Layout,
    written: Path,
    progress: Progress | None,
    selection: LayoutOptions | None = None,
    model_check: ModelCheck | None = None,
) -> RoundTrip:
    """Open what was written like ``restore`` does (structure, checksums, padding),
    compare every tensor's bytes with the source's, then (with an architecture)
    run ``model_check`` (``yafsdp verify``'s check) on the same selection."""
    ckpt = open_flat(written)
    ckpt.verify(progress)
    mismatches = [] if ckpt.layout == layout else ["layout"]
    reads, count, compared = _Reads(loaded), 0, 0
    total = sum(e.numel * dtypes.itemsize(b.dtype) for b in layout.buffers for e in b.entries)
    total += sum(t.nbytes for t in stored_kept(layout))
    for b in layout.buffers:
        isz = dtypes.itemsize(b.dtype)
        for e in b.entries:
            flat = ckpt.read_range(b, e.offset * isz, (e.offset + e.numel) * isz)
            if not equal_streams(reads.tensor(e, e.numel * isz), flat):
                mismatches.append(e.name)
            count, compared = count + 1, compared + e.numel * isz
            _tick(progress, compared, total)
    for t in stored_kept(layout):
        if not equal_streams(reads.tensor(t, t.nbytes), ckpt.kept_bytes(t.name)):
            mismatches.append(t.name)
        count, compared = count + 1, compared + t.nbytes
        _tick(progress, compared, total)
    if model_check is None:
        model_ok, model_text = None, "not run: no model check given"
    elif selection is None:
        model_ok, model_text = None, "not run: no selection to convert with"
    else:  # the check runs in one process: the selection at world size 1
        one = dataclasses.replace(selection, world_size=1)
        model_ok, model_text = model_check(loaded, one)
    return RoundTrip(
        ok=not mismatches and model_ok is not False,
        tensors=count,
        nbytes=compared,
        mismatches=tuple(mismatches),
        model_check=model_text,
        model_ok=model_ok,
    )


def _tick(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress("comparing", done, total)


def equal_streams(a, b) -> bool:
    """Two chunk streams hold the same bytes (chunk boundaries may differ). Each
    iterator is advanced only once its current chunk is used up."""
    ia, ib = iter(a), iter(b)
    ca = cb = memoryview(b"")
    while True:
        while ca is not None and not len(ca):
            ca = _next(ia)
        while cb is not None and not len(cb):
            cb = _next(ib)
        if ca is None or cb is None:
            return ca is None and cb is None
        n = min(len(ca), len(cb))
        if ca[:n].tobytes() != cb[:n].tobytes():
            return False
        ca, cb = ca[n:], cb[n:]


def _next(it):
    chunk = next(it, None)
    return None if chunk is None else memoryview(chunk).cast("B")
