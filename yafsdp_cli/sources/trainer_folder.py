"""A Hugging Face Trainer checkpoint folder (``checkpoint-N/``): its training state.

The Trainer writes the weights with ``save_pretrained`` (``model.safetensors``, or
shards and their index; read by the Hugging Face folder source, which builds the
architecture from ``config.json``), ``optimizer.state_dict()`` as ``optimizer.pt``,
and the rest of the loop as small files: ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``, ``training_args.bin``, ``config.json``, ...

``optimizer.pt`` numbers the parameters by the Trainer's own param groups
(``Trainer.create_optimizer``): group 0 holds the trainable parameters whose names
``Trainer.get_decay_parameter_names`` lists, group 1 the other trainable ones, each in
``named_parameters()`` order (a tied parameter once, under its first name), numbered
on across the groups. The names are checked: each group's size here, every state
tensor's shape against its parameter's in ``optim_state.state_dtypes``.

Every other file of the folder is carried as its bytes, never unpickled
(``training_args.bin`` and ``rng_state.pth`` pickle arbitrary classes), so ``restore``
writes it back byte for byte; they travel in the optimizer record, which every rank
file repeats, so their total is bounded (``MAX_FILES_BYTES``, counted in bytes read:
a ``/proc`` file says 0 bytes and gives more).

Nothing is read through a symbolic link out of the folder (``fileio.require_inside``):
the checkpoint carries its files to whoever restores it, and a link to
``/proc/self/environ`` or a home folder would carry a file nobody chose to share. An
``optimizer.pt`` that cannot be read (a FIFO, a folder, a dangling link) is an error,
not a folder without optimizer state: converting its weights alone is
``--weights-only``'s to ask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError
from ..fileio import not_a_file, read_capped, require_inside
from .loaded import LoadedModel
from .safetensors_file import SafetensorsReader

OPTIMIZER_FILE = "optimizer.pt"
# A Trainer folder's other files are KBs (scheduler, RNG states, arguments) up to a
# few MB (trainer_state.json's log history, a tokenizer.json); each rank file of a
# sharded set repeats them, so a folder holding much more is refused, not multiplied.
MAX_FILES_BYTES = 16 << 20


@dataclass(frozen=True)
class TrainerFolder:
    osd: dict  # optimizer.pt's optimizer.state_dict()
    names: dict[int, str]  # its parameter numbers -> parameter names
    files: dict[str, bytes]  # every other file but the weights, as it is
    weights: dict[str, tuple[str, ...]]  # weights file -> the tensor names it stores


def trainer_folder_of(loaded: LoadedModel) -> Path | None:
    """The Trainer folder ``loaded`` comes from (one holding ``optimizer.pt``, whatever
    it is: ``read_trainer_folder`` refuses one it cannot read): the source folder, or
    the weights' folder when it was read as its weights alone (without transformers),
    or None."""
    path = loaded.path
    if path is None:
        return None
    folder = path if path.is_dir() else path.parent if "architecture_hint" in loaded.extra else None
    return folder if folder is not None and os.path.lexists(folder / OPTIMIZER_FILE) else None


def read_trainer_folder(loaded: LoadedModel) -> TrainerFolder:
    """The optimizer state, weights files and other files of Trainer folder ``loaded``."""
    from .torch_file import load_torch_file

    folder = trainer_folder_of(loaded)
    where = str(folder)
    optimizer = _optimizer_file(folder, where)
    weights = _weight_files(loaded, folder, where)
    files = _carried_files(folder, {*weights, OPTIMIZER_FILE}, where)
    osd, _ = load_torch_file(optimizer, trust_pickle=False)
    names = trainer_param_names(loaded.module, osd, f"{where}/{OPTIMIZER_FILE}")
    return TrainerFolder(osd, names, files, weights)


def _optimizer_file(folder: Path, where: str) -> Path:
    """``optimizer.pt``, a readable regular file in the folder; anything else (a FIFO,
    which would block, a socket, a device, a folder, a dangling or looping link, a file
    we may not open) is refused: its state would otherwise be dropped without a word."""
    path = folder / OPTIMIZER_FILE
    require_inside(folder, path, where=where)
    try:
        what = not_a_file(os.stat(path).st_mode)
        if what is None:
            with open(path, "rb"):  # a regular file opens without blocking
                return path
        why = f"not a regular file ({what})"
    except OSError as exc:
        why = f"cannot read ({exc.strerror})"
    raise SourceError(
        f"{path}: {why}; it holds the Trainer checkpoint's optimizer state; pass "
        "--weights-only to skip it and convert the weights alone"
    )


def _weight_files(loaded: LoadedModel, folder: Path, where: str) -> dict[str, tuple[str, ...]]:
    """Each safetensors weights file's name and the tensor names it stores, every one
    a name of the architecture (so restore writes them under the same names)."""
    reader = loaded.reader
    if "architecture_hint" in loaded.extra:  # a folder read without transformers
        raise SourceError(
            f"{where}: a Trainer checkpoint; naming its optimizer.pt's parameters needs the "
            f"architecture ({loaded.extra['architecture_hint']}); or pass --weights-only"
        )
    if loaded.module is None or not isinstance(reader, SafetensorsReader):
        raise SourceError(
            f"{where}: a Trainer checkpoint whose weights are not safetensors beside a "
            "config.json; its optimizer.pt is read only with model.safetensors (or its "
            "shards); pass --weights-only to convert the weights alone"
        )
    known = loaded.spec.by_name()
    out = {}
    for h in reader.headers:
        require_inside(folder, h.path, where=where)
        names = tuple(e.name for e in h.entries)
        stray = next((n for n in names if n not in known), None)
        if stray is not None:
            raise SourceError(
                f"{where}: {h.path.name} stores {stray!r}, which is no tensor of the "
                "architecture by that name; restore could not write it back as it was; pass "
                "--weights-only to convert the weights alone"
            )
        out[h.path.name] = names
    return out


def _carried_files(folder: Path, skip: set[str], where: str) -> dict[str, bytes]:
    """The folder's other files (name -> bytes): each in the folder, a regular file,
    and all of them together at most ``MAX_FILES_BYTES``, by their sizes before any is
    read and by the bytes read (a ``/proc`` file's size says 0)."""
    paths = sorted(p for p in folder.iterdir() if p.name not in skip)
    sizes = {}
    for p in paths:
        require_inside(folder, p, where=where)
        try:
            st = os.stat(p)
        except OSError as exc:
            raise SourceError(
                f"{p}: cannot read ({exc.strerror}); move it out, or pass --weights-only"
            ) from None
        what = not_a_file(st.st_mode)
        if what == "a folder":
            raise SourceError(
                f"{where}: {p.name} is not a file; a Trainer checkpoint's files are carried, "
                "its subfolders are not; move it out, or pass --weights-only"
            )
        if what is not None:
            raise SourceError(
                f"{where}: {p.name} is {what}, not a file to carry; move it out, or pass "
                "--weights-only"
            )
        sizes[p.name] = st.st_size
    if sum(sizes.values()) > MAX_FILES_BYTES:
        _too_much(where, sizes, f"hold {sum(sizes.values())} bytes")
    files, total = {}, 0
    for p in paths:
        # one file's read stops past the cap, so at most twice the cap is ever held
        what = "a file the Trainer checkpoint carries (move it out, or pass --weights-only)"
        files[p.name] = read_capped(p, MAX_FILES_BYTES, what=what)
        total += len(files[p.name])
        if total > MAX_FILES_BYTES:
            read = {n: len(b) for n, b in files.items()}
            _too_much(
                where,
                read,
                f"give {total} bytes when read, though their sizes say {sum(sizes.values())}",
            )
    return files


def _too_much(where: str, sizes: dict[str, int], hold: str) -> None:
    big = max(sizes, key=sizes.__getitem__)
    raise SourceError(
        f"{where}: its files besides the weights and optimizer.pt {hold} ({big}: "
        f"{sizes[big]}), more than the {MAX_FILES_BYTES} carried in the checkpoint's "
        f"metadata; move {big} out of the folder (and back beside the restored one), or "
        "pass --weights-only"
    )


def trainer_param_names(module, osd: object, where: str) -> dict[int, str]:
    """optimizer parameter number -> parameter name, by the Trainer's two groups."""
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(groups, list) or not isinstance(osd.get("state"), dict):
        raise SourceError(f"{where}: no 'state' and 'param_groups'; not an optimizer.state_dict()")
    expected = _trainer_groups(module, where)
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups]
    if sizes != [len(e) for e in expected]:
        raise SourceError(
            f"{where}: param groups of {sizes} parameters, but the Trainer's weight-decay "
            f"groups of {type(module).__name__} hold {[len(e) for e in expected]}; the "
            "optimizer was not built by Trainer.create_optimizer over these parameters (one "
            "frozen, another optimizer, an edited file); pass --weights-only"
        )
    ids = [p for g in groups for p in g["params"]]
    if not all(isinstance(p, int) for p in ids) or len(set(ids)) != len(ids):
        raise SourceError(f"{where}: param group ids {ids[:8]} are not distinct integers")
    return {p: n for g, names in zip(groups, expected) for p, n in zip(g["params"], names)}


def _trainer_groups(module, where: str) -> tuple[list[str], list[str]]:
    """The names in ``Trainer.create_optimizer``'s groups: decayed, then not decayed."""
    try:
        from transformers import Trainer

        # a method that reads no Trainer state: the installed rule, without a Trainer
        decay = set(Trainer.get_decay_parameter_names(None, module))
    except Exception as exc:
        raise SourceError(
            f"{where}: the Trainer's weight-decay names cannot be computed "
            f"({type(exc).__name__}: {exc}); pass --weights-only"
        ) from None
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    return [n for n in trainable if n in decay], [n for n in trainable if n not in decay]
