"""``restore_checkpoint``: a flat checkpoint back to an ordinary state dict, bit for bit.

This package is ``yafsdp restore``: reading a flat checkpoint back in one place and
one module per output format, so that a new output is one more module beside them.

- ``read_back``: the flat checkpoint as named tensors (each entry's slice and each
  kept tensor as byte ranges of the flat files), and a training checkpoint's weights,
  optimizer state tensors and other values under the source's key paths; every
  output is written from these;
- ``to_file``: one ``.safetensors`` file (streamed: copied by range and checksummed
  in one pass) or ``torch.save`` (``.pt``/``.pth``/``.bin``), weights alone or a
  training checkpoint in its source's nesting;
- ``to_dcp``: a torch.distributed.checkpoint folder (``--format dcp``), written
  without torch (``dcp_write.py``), weights alone or a DCP training checkpoint;
- ``to_trainer``: the Hugging Face Trainer folder a checkpoint was converted from
  (``--format trainer``).

This module picks the output: from ``--format`` or the output's suffix, and for a
checkpoint with optimizer state (``optim_state.py``) the format its source had,
unless ``weights_only``. Every output is staged beside its target and renamed only
after every checksum and the zero padding of the input were verified.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointError
from ..reader import open_flat
from ..results import Progress, RestoreResult, restored
from .read_back import state_dict_items

PT_SUFFIXES = (".pt", ".pth", ".bin")
FORMATS = ("safetensors", "pt", "dcp", "trainer")
FORMS = {"dcp": "dcp", "pt": "pt", "trainer": "trainer"}  # record form -> restore --format


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
    temporary; a mismatch removes it). A checkpoint with optimizer state is written in
    its source's own layout unless ``weights_only``."""
    out = Path(out)
    fmt = _format_of(out, fmt)
    ckpt = open_flat(flat)
    if fmt == "trainer" and (ckpt.optim is None or weights_only):
        why = "--weights-only asks for the weights alone" if weights_only else "it holds none"
        raise CheckpointError(
            f"--format trainer writes a Trainer checkpoint folder with its optimizer state, "
            f"but {why}; choose --format safetensors, pt or dcp"
        )
    items = state_dict_items(ckpt)
    if ckpt.optim is not None and not weights_only:
        if fmt == "trainer" and ckpt.optim.form == "trainer":
            from .to_trainer import restore_trainer

            return restore_trainer(ckpt, out, items, force=force, progress=progress)
        return _restore_training(ckpt, out, fmt, items, force=force, progress=progress)
    if fmt == "dcp":
        from .to_dcp import restore_dcp

        return restore_dcp(ckpt, out, items, force=force, progress=progress)
    from .to_file import restore_file

    return restore_file(ckpt, out, fmt, items, force=force, progress=progress)


def _restore_training(
    ckpt, out: Path, fmt: str, items: list, *, force: bool, progress: Progress | None
) -> RestoreResult:
    """A training checkpoint back in its source's layout: a DCP folder or a
    ``torch.save`` dict with the source's nesting, whichever the source was."""
    want = FORMS.get(ckpt.optim.form)
    if want != fmt:
        raise CheckpointError(
            f"this checkpoint carries optimizer state from a {ckpt.optim.form} checkpoint, "
            f"which is restored as --format {want}; pass --weights-only for the weights "
            f"alone as {fmt}"
        )
    from .read_back import training_items

    tensors = training_items(ckpt, items)
    if fmt == "dcp":
        from .to_dcp import write_training_dcp

        nbytes, checked = write_training_dcp(ckpt, out, tensors, force=force, progress=progress)
    else:
        from .to_file import write_training_pt

        nbytes, checked = write_training_pt(ckpt, out, tensors, force=force, progress=progress)
    return restored(ckpt, out, nbytes=nbytes, checked=checked, fmt=fmt, tensors=len(tensors))


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
