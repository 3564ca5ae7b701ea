"""``restore_checkpoint``: a flat checkpoint back to the ordinary state dict.

Every entry's slice and every kept tensor is copied out by byte ranges, so each
tensor is bit for bit what the source held. The bytes are read once: each range
is copied and checksummed in one pass (``file_ranges.Copier`` with a ledger), then
``verify`` combines those checksums with what was not copied (padding, replicas),
read there, and compares them with the stored ones before the output is renamed. Tied names follow
``safetensors.torch.save_model``: a tied tensor is stored once, under its first
name, and the metadata maps each dropped name to the stored one, so
``safetensors.torch.load_model(model, path)`` and yafsdp itself see the tie. A
``.pt`` output is ``torch.save`` of a dict with every name, tied names sharing one
tensor (it holds the model in memory once; ``.safetensors`` output streams).
``fmt="dcp"`` writes a torch.distributed.checkpoint folder instead (``dcp_restore.py``).
A checkpoint that carries optimizer state is restored in its source's layout, state
included (``train_restore.py``; ``fmt="trainer"``: a Hugging Face Trainer folder,
``trainer_restore.py``); ``weights_only`` gives the weights as above.
"""

from __future__ import annotations

from pathlib import Path

from ..engine import dtypes
from ..errors import CheckpointError
from .file_ranges import Copier
from .flat_writer import stored_kept
from .format import YAFSDP_KEYS, TensorSlot
from .reader import FlatCheckpoint, StateDictItem, open_flat
from .results import Progress, RestoreResult, restored
from .writer import check_output, page_phase, staged_output, torch_save, write_safetensors

PT_SUFFIXES = (".pt", ".pth", ".bin")
FORMATS = ("safetensors", "pt", "dcp", "trainer")


def state_dict_items(ckpt: FlatCheckpoint) -> list[StateDictItem]:
    """Entries (flat order) and stored kept tensors, each with its byte source."""
    items = []
    for b in ckpt.layout.buffers:
        isz = dtypes.itemsize(b.dtype)
        for e in b.entries:
            start, stop = e.offset * isz, (e.offset + e.numel) * isz

            def ranges(b=b, start=start, stop=stop):
                return ckpt.ranges(b, start, stop)

            items.append(StateDictItem(TensorSlot(e.name, e.dtype, e.shape), e.aliases, ranges))
    for t in stored_kept(ckpt.layout):
        slot = TensorSlot(t.name, t.dtype, t.shape)
        items.append(StateDictItem(slot, t.aliases, lambda n=t.name: [ckpt.kept_range(n)]))
    return items


def restore_checkpoint(
    flat: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    progress: Progress | None = None,
    fmt: str | None = None,
    weights_only: bool = False,
) -> RestoreResult:
    """Write the state dict of flat checkpoint ``flat`` (file, set folder or index)
    to ``out`` (``.safetensors``, or ``.pt``/``.pth``/``.bin``; with ``fmt="dcp"`` a
    torch.distributed.checkpoint folder; with ``fmt="trainer"`` the Trainer folder a
    checkpoint with Trainer state was converted from). Every checksum and the zero
    padding are verified before ``out`` appears: for ``.safetensors`` in the same pass
    as the copy (the bytes are read once, checksummed and written to the hidden
    temporary; a mismatch removes it). A checkpoint with optimizer state is written in its
    source's own layout (``train_restore.py``) unless ``weights_only``."""
    out = Path(out)
    fmt = _format_of(out, fmt)
    ckpt = open_flat(flat)
    if fmt == "trainer" and (ckpt.optim is None or weights_only):
        why = "--weights-only asks for the weights alone" if weights_only else "it holds none"
        raise CheckpointError(
            f"--format trainer writes a Trainer checkpoint folder with its optimizer state, "
            f"but {why}; choose --format safetensors, pt or dcp"
        )
    if ckpt.optim is not None and not weights_only:
        items = state_dict_items(ckpt)
        if fmt == "trainer" and ckpt.optim.form == "trainer":
            from .trainer_restore import restore_trainer

            return restore_trainer(ckpt, out, items, force=force, progress=progress)
        from .train_restore import restore_training

        return restore_training(ckpt, out, fmt, items, force=force, progress=progress)
    if fmt == "dcp":
        from .dcp_restore import restore_dcp

        return restore_dcp(ckpt, out, state_dict_items(ckpt), force=force, progress=progress)
    check_output(out, inputs=list(ckpt.paths), force=force, folder=False)
    copier = Copier(record=True)
    items = state_dict_items(ckpt)
    tied = {a: it.slot.name for it in items for a in it.aliases}
    with staged_output(out, folder=False, force=force) as staged:
        if fmt == "pt":
            checked = ckpt.verify(progress, copier)  # before anything is held in memory
            _write_pt(staged.temp, items, progress)
        else:
            meta = _metadata(ckpt, tied)
            write_safetensors(staged.temp, items, meta, progress, copier, page_phase(ckpt.paths))
            checked = ckpt.verify(progress, copier)  # reads only what was not copied
        nbytes = staged.temp.stat().st_size
    return restored(
        ckpt, out, nbytes=nbytes, checked=checked, fmt=fmt, tensors=len(items), tied=tied
    )


def _format_of(out: Path, fmt: str | None = None) -> str:
    if fmt not in (None, *FORMATS):
        raise CheckpointError(f"--format {fmt!r} is not one of {' | '.join(FORMATS)}")
    if fmt in ("dcp", "trainer"):  # folders
        return fmt
    if out.name.endswith(".safetensors"):
        found = "safetensors"
    elif out.name.endswith(PT_SUFFIXES):
        found = "pt"
    else:
        raise CheckpointError(
            f"output {out}: give a .safetensors file (or .pt/.pth/.bin for torch.save, or "
            "--format dcp for a torch.distributed.checkpoint folder)"
        )
    if fmt is not None and fmt != found:
        raise CheckpointError(f"output {out} is a {found} file name, but --format is {fmt}")
    return found


def _metadata(ckpt: FlatCheckpoint, tied: dict[str, str]) -> dict[str, str]:
    """The source's own metadata (minus stale tie records), ties, ``format: pt``."""
    names = {it for b in ckpt.layout.buffers for e in b.entries for it in e.names}
    names |= {n for t in ckpt.layout.kept for n in t.names}
    meta = {
        k: v for k, v in ckpt.source_metadata.items() if k not in names and k not in YAFSDP_KEYS
    }
    return {**meta, **tied, "format": "pt"}


def _write_pt(path: Path, items, progress) -> None:
    import torch

    state: dict = {}
    total, done = sum(it.slot.nbytes for it in items), 0
    for it in items:
        data = bytearray(it.slot.nbytes)
        pos = 0
        for chunk in it.read():
            data[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        dtype = dtypes.to_torch(it.slot.dtype)
        if data:
            tensor = torch.frombuffer(data, dtype=dtype).reshape(it.slot.shape)
        else:
            tensor = torch.empty(it.slot.shape, dtype=dtype)
        for name in (it.slot.name, *it.aliases):
            state[name] = tensor
        done += len(data)
        if progress is not None:
            progress("writing", done, total)
    torch_save(state, path)
