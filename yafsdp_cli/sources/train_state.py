"""A training checkpoint's state beside its weights: optimizer state and the rest.

``read_training_state`` splits what a source holds besides the weights into
per-parameter state tensors (``StateTensor``: AdamW's moments, SGD's momentum; read
lazily by name through ``TrainingState.reader``) and everything else as Python
values under their key paths (step counts, param groups, a scheduler's and the
train loop's entries). Key paths are those of the source's nesting, so a writer can
rebuild it: a DCP folder's come from its metadata (``dcp.save`` records each
flattened key's path), a ``torch.save`` dict's from walking it.

Optimizer state is keyed by parameter name in DCP (``optimizer.state.NAME.FIELD``, or
``optimizer.state.NAME.FIELD`` as one key in the flattened form of
``get_optimizer_state_dict``); ``torch.save(optimizer.state_dict())`` numbers the
parameters instead, in the order the optimizer was given them, which only the
architecture knows (``--model``: its ``parameters()`` order; a Trainer folder's
``optimizer.pt``: the Trainer's weight-decay groups, ``trainer_folder.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import SourceError
from .dcp_folder import OPTIMIZER_KEYS, DcpReader, cause
from .loaded import LoadedModel, TensorReader
from .state import IntKey

TORCH_SUFFIXES = (".pt", ".pth", ".bin")

# A non-weight tensor beyond this is neither per-parameter state nor a counter;
# carrying it in the metadata would make the header as big as a model.
MAX_EXTRA_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One per-parameter state tensor of a source, and where it sits in it."""

    param: str
    field: str
    path: tuple  # its key path in the source's nested checkpoint
    key: str  # the name ``TrainingState.reader`` knows it by
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TrainingState:
    form: str  # "dcp", "pt" or "trainer"
    model_path: tuple  # key path of the weights: ("model",) or ()
    tensors: tuple[StateTensor, ...]
    scalars: dict[str, dict[str, Any]]  # param -> field -> scalar state (step)
    extras: tuple[tuple[tuple, Any], ...]  # (key path, value): everything else
    reader: TensorReader | None  # the state tensors, by their keys
    where: str
    # a Trainer folder's other files, as they are, and each weights file's stored names
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    weights: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def read_training_state(loaded: LoadedModel) -> TrainingState | None:
    """The training state of ``loaded``'s source, or None when it holds weights only."""
    from .trainer_folder import trainer_folder_of

    reader = loaded.reader
    if trainer_folder_of(loaded) is not None:
        return _from_trainer(loaded)
    if isinstance(reader, DcpReader):
        return _from_dcp(reader, loaded.spec.source, loaded)
    if loaded.path is not None and loaded.path.suffix in TORCH_SUFFIXES:
        return _from_torch(loaded)
    return None


def _state_key(path: tuple) -> tuple[str, str] | None:
    """(param, field) when ``path`` is per-parameter optimizer state."""
    if len(path) < 2 or str(path[0]) not in OPTIMIZER_KEYS:
        return None
    if len(path) == 4 and path[1] == "state":
        return str(path[2]), str(path[3])
    if len(path) == 2 and str(path[1]).startswith("state."):  # flattened form
        param, dot, field = str(path[1])[6:].rpartition(".")
        return (param, field) if dot else None
    return None


def _from_dcp(reader: DcpReader, where: str, loaded: LoadedModel) -> TrainingState | None:
    md = reader.md
    model_fqns = set(reader.fqns.values())
    name, fqn = next(iter(reader.fqns.items()))
    model_path = (fqn[: -len(name) - 1],) if fqn != name else ()
    tensors, scalars, extra_fqns = [], {}, []
    for fqn in list(md.tensors) + list(md.non_tensors):
        if fqn in model_fqns:
            continue
        path = tuple(md.paths.get(fqn, (fqn,)))
        key = _state_key(path)
        meta = md.tensors.get(fqn)
        if key is not None and meta is not None and key[1] != "step":
            tensors.append(StateTensor(key[0], key[1], path, fqn, meta.dtype, meta.shape))
            continue
        if meta is not None and meta.nbytes > MAX_EXTRA_BYTES:
            raise SourceError(
                f"{where}: {fqn!r} is a {meta.nbytes}-byte tensor that is neither a weight nor "
                "per-parameter optimizer state; pass --weights-only to convert the weights alone"
            )
        extra_fqns.append((fqn, path))
    if not tensors and not extra_fqns and not model_path:
        return None
    values = _load_values(md, [f for f, _ in extra_fqns], where)
    extras = []
    for fqn, path in extra_fqns:
        key = _state_key(path)
        if key is not None:
            scalars.setdefault(key[0], {})[key[1]] = values[fqn]
        extras.append((path, values[fqn]))
    if _numbered(tensors, reader.fqns):
        names = _dcp_param_names(loaded, tensors, extras, where)
        tensors = [dataclasses.replace(t, param=names[t.param]) for t in tensors]
        scalars = {names.get(p, p): v for p, v in scalars.items()}
    state_reader = DcpReader(md, {t.key: t.key for t in tensors}) if tensors else None
    return TrainingState(
        "dcp", model_path, tuple(tensors), scalars, tuple(extras), state_reader, where
    )


def _numbered(tensors: list[StateTensor], weights: dict[str, str]) -> bool:
    """Whether the optimizer state is keyed by position (``dcp.save`` of a plain
    ``optimizer.state_dict()``: ``optimizer.state.0.exp_avg``) rather than by name."""
    params = {t.param for t in tensors}
    return (
        bool(params)
        and all(p.isascii() and p.isdigit() and len(p) < 19 for p in params)
        and not (params & set(weights))
    )


def _dcp_param_names(
    loaded: LoadedModel, tensors: list[StateTensor], extras: list, where: str
) -> dict[str, str]:
    """Position (as the state's key) -> parameter name, through ``--model``'s
    ``parameters()`` order, as for ``torch.save(optimizer.state_dict())``; the
    positions are those the param groups list, in order."""
    groups: dict[int, Any] = {}
    for path, value in extras:
        if len(path) == 4 and path[1] == "param_groups" and path[3] == "params":
            groups[path[2]] = value
    order = sorted(i for i in groups if type(i) is int)
    ids = [p for i in order if isinstance(groups[i], list) for p in groups[i]]
    if not ids or not all(type(p) is int for p in ids):
        ids = sorted({int(t.param) for t in tensors})
    how = (
        f"by position (0..{max(ids)}), as optimizer.state_dict() does; give the architecture "
        "with --model package.module:factory so the positions can be named, save it with "
        "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict (which keys it "
        "by name), or pass --weights-only"
    )
    params = _positions_named(loaded, ids, where, how)
    names = {str(i): n for i, n in zip(ids, params, strict=True)}
    missing = sorted({t.param for t in tensors} - set(names), key=int)
    if missing:
        raise SourceError(
            f"{where}: the optimizer holds state for parameter {missing[0]}, which no param "
            "group lists; not an optimizer.state_dict()"
        )
    return names


def _load_values(md, fqns: list[str], where: str) -> dict[str, Any]:
    """The values of small tensors (as ``RawTensor``) and pickled items, read without
    torch (``dcp_data.read_values``); where one of them needs torch's reader, all of
    them by ``dcp.load`` with a planner that unpickles with ``weights_only=True``
    (numbers, strings, tuples, tensors), which reads or refuses them as it always did."""
    from .dcp_data import read_values

    found = read_values(md, fqns)
    if found is not None:
        return found
    return _load_values_with_torch(md, fqns, where)


def _load_values_with_torch(md, fqns: list[str], where: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .dcp_folder import _storage_reader

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as exc:  # an unpickling error names what it refused
                raise SourceError(
                    f"{where}: {read_item.dest_index.fqn!r} cannot be loaded safely ({exc})"
                ) from None
            self.original_state_dict[self.mappings[read_item.dest_index.fqn][0]] = obj

    state: dict[str, Any] = {}
    for fqn in fqns:
        meta = md.tensors.get(fqn)
        state[fqn] = (
            torch.empty(meta.shape, dtype=_torch_dtype(meta.dtype)) if meta is not None else None
        )
    if not state:
        return state
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                state, storage_reader=_storage_reader(md), planner=_SafePlanner(), no_dist=True
            )
    except (Exception, CheckpointException) as exc:
        inner = next(iter(getattr(exc, "failures", {}).values()), (None,))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, SourceError):
            raise inner from None
        raise SourceError(f"{where}: reading the training state failed ({cause(exc)})") from None
    return state


def _torch_dtype(name: str):
    from ..engine import dtypes

    return dtypes.to_torch(name)


# ---------------------------------------------------------------- torch.save dicts


def _from_torch(loaded: LoadedModel) -> TrainingState | None:
    """``torch.save({"model": sd, "optimizer": opt.state_dict(), ...})``: the
    optimizer's parameter numbers named through ``--model``'s ``parameters()`` order
    (the order ``torch.optim.AdamW(model.parameters())`` numbers them in)."""
    from .torch_file import _NESTED_KEYS, TensorDictReader, load_torch_file

    where = loaded.spec.source
    obj, _ = load_torch_file(loaded.path, trust_pickle=False)
    if not isinstance(obj, dict):
        return None
    opt_key = next((k for k in OPTIMIZER_KEYS if isinstance(obj.get(k), dict)), None)
    model_key = next((k for k in _NESTED_KEYS if isinstance(obj.get(k), dict)), None)
    if opt_key is None or model_key is None:
        return None
    osd = obj[opt_key]
    names = _param_names(loaded, osd, where)
    tensors, scalars, extras, found = optimizer_entries(osd, names, (opt_key,), where)
    extras += [((k,), v) for k, v in obj.items() if k not in (opt_key, model_key)]
    reader = TensorDictReader(found) if found else None
    return TrainingState("pt", (model_key,), tuple(tensors), scalars, tuple(extras), reader, where)


def _from_trainer(loaded: LoadedModel) -> TrainingState:
    """A Trainer folder (``trainer_folder.py``): ``optimizer.pt`` under key path
    ``("optimizer.pt",)``, the weights files' names and the other files' bytes."""
    from .torch_file import TensorDictReader
    from .trainer_folder import OPTIMIZER_FILE, read_trainer_folder

    got = read_trainer_folder(loaded)
    where = str(loaded.path)
    tensors, scalars, extras, found = optimizer_entries(
        got.osd, got.names, (OPTIMIZER_FILE,), where
    )
    reader = TensorDictReader(found) if found else None
    state = (tuple(tensors), scalars, tuple(extras), reader, where, got.files, got.weights)
    return TrainingState("trainer", (), *state)


def optimizer_entries(osd: dict, names: dict[int, str], prefix: tuple, where: str):
    """An ``optimizer.state_dict()`` at key path ``prefix``, split: its state tensors,
    each parameter's scalars, every other value under its key path, and the tensors
    by the key ``TensorDictReader`` gives them."""
    import torch

    tensors, scalars, extras, found = [], {}, [], {}
    for pid, fields in osd.get("state", {}).items():
        param = names.get(pid)
        if param is None:
            raise SourceError(
                f"{where}: the optimizer holds state for parameter {pid!r}, which no param "
                "group lists; not an optimizer.state_dict()"
            )
        for name, value in fields.items():
            path = (*prefix, "state", IntKey(pid), name)
            if isinstance(value, torch.Tensor) and name != "step":
                key = f"{pid}.{name}"
                found[key] = value
                dtype = _dtype_name(value.dtype)
                tensors.append(StateTensor(param, name, path, key, dtype, tuple(value.shape)))
            else:
                scalars.setdefault(param, {})[name] = value
                extras.append((path, value))
    extras += [((*prefix, k), v) for k, v in osd.items() if k != "state"]
    if "state" in osd and not osd["state"]:
        extras.append(((*prefix, "state"), {}))
    return tensors, scalars, extras, found


def _param_names(loaded: LoadedModel, osd: dict, where: str) -> dict[int, str]:
    """optimizer parameter number -> parameter name."""
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not isinstance(osd.get("state"), dict):
        raise SourceError(
            f"{where}: the optimizer entry has no 'state' and 'param_groups'; not an "
            "optimizer.state_dict()"
        )
    ids = [p for g in groups for p in g.get("params", [])]
    if not all(isinstance(p, int) for p in ids):
        return {p: str(p) for p in ids}  # already named
    how = (
        f"(0..{len(ids) - 1}); give the architecture with --model package.module:factory "
        "so they can be named, or pass --weights-only"
    )
    return dict(zip(ids, _positions_named(loaded, ids, where, how)))


def _positions_named(loaded: LoadedModel, ids: list, where: str, how: str) -> list[str]:
    """``--model``'s parameter names in ``parameters()`` order, one for each of the
    optimizer's ``ids``; without ``--model``, the error says the state is numbered
    ``how``."""
    if loaded.module is None:
        raise SourceError(f"{where}: the optimizer state numbers its parameters {how}")
    params = [n for n, _ in loaded.module.named_parameters()]
    if len(params) != len(ids):
        raise SourceError(
            f"{where}: the optimizer holds {len(ids)} parameters, but --model has "
            f"{len(params)}; the optimizer was not built over model.parameters()"
        )
    return params


def _dtype_name(dtype) -> str:
    from ..engine import dtypes

    return dtypes.from_torch(dtype)
