"""Optimizer state in a flat checkpoint: state buffers and the ``yafsdp.optimizer`` record.

Each per-parameter state tensor (AdamW's ``exp_avg`` and ``exp_avg_sq``, Adam's
``max_exp_avg_sq`` with ``amsgrad``, SGD's ``momentum_buffer``) of the parameters of
flat buffer ``B`` is stored as its own flat buffer ``B@FIELD``: the same entries at
the same element offsets, the same padding and the same shards as ``B``, so that
rank ``r`` holds the state of exactly the parameter slices it holds, and reshard
moves it with the same byte ranges. Only the element type may differ (a state
buffer has the dtype of the state, e.g. float32 moments of bfloat16 weights).
A parameter the optimizer keeps no state for has zeros there, and no path.

Everything else the training checkpoint held (step counts, param groups and their
hyperparameters, a scheduler's or the train loop's entries) is JSON in the
``yafsdp.optimizer`` metadata record, each value under the key path it had in the
source, so that ``restore`` rebuilds the source's own nesting bit for bit. A
Trainer folder's record also names its weights files and the tensors each stores,
and holds its other files (``scheduler.pt``, ``trainer_state.json``, ...) as
base64 with a checksum each (``files``), written back byte for byte.

Understood: Adam and AdamW (``exp_avg``, ``exp_avg_sq``, optional
``max_exp_avg_sq``, scalar ``step``, one value for every parameter) and SGD
(optional ``momentum_buffer``), either with float32 master weights
(``master_weights.py``). State of any other optimizer is refused by name.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine import dtypes
from ..engine.layout import BufferLayout, Layout
from ..errors import CheckpointError, YafsdpError
from ..sources.state import IntKey
from ..sources.torch_pickle import RawTensor
from .format import checksum_of
from .master_weights import (
    MASTER_STATES,
    check_master_dtype,
    check_masters,
    check_recorded_masters,
    master_field,
    refuse_param_copies,
)

if TYPE_CHECKING:  # the sources that hold state import torch; this module does not
    from ..sources.train_state import StateTensor, TrainingState

MAX_VALUE_BYTES = 1 << 20  # a tensor value kept in the metadata (a counter, a scheduler's)
SEP = "@"  # state buffer name: f"{buffer}{SEP}{field}"
ADAM_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SGD_TENSORS = ("momentum_buffer",)
# State fields of torch optimizers yafsdp does not understand, to name them when refused.
OTHER_OPTIMIZERS = {
    "acc_delta": "Adadelta",
    "square_avg": "RMSprop",
    "sum": "Adagrad",
    "exp_inf": "Adamax",
    "mu_product": "NAdam",
    "prev": "Rprop",
    "step_size": "Rprop",
    "eta": "ASGD",
    "ax": "ASGD",
}


@dataclass(frozen=True)
class OptimState:
    """The ``yafsdp.optimizer`` record (without the state buffers' bytes)."""

    kind: str  # "adam" (Adam or AdamW) or "sgd"
    form: str  # the source's layout: "dcp", "pt" or "trainer"
    model_path: tuple  # key path of the weights (("model",) or ())
    dtypes: dict[str, dict[str, str]]  # field -> buffer name -> dtype
    paths: dict[str, dict[str, list]]  # param -> field -> key path
    extras: list  # [[key path, encoded value], ...]
    # a Trainer folder: weights file -> stored names; file -> {"checksum", "base64"}
    weights: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    files: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def masters(self) -> str | None:
        """The field that holds float32 master weights, if the run kept them."""
        return master_field(self.dtypes)

    def state_buffers(self, layout: Layout) -> tuple[BufferLayout, ...]:
        """The state buffers: each a copy of its parameter buffer's layout. Masters
        have buffers only where parameters have them (float32 ones step themselves)."""
        out = []
        for field in sorted(self.dtypes):
            for b in layout.buffers:
                if field in MASTER_STATES and b.name not in self.dtypes[field]:
                    continue
                dtype = self.dtypes[field].get(b.name, b.dtype)
                out.append(dataclasses.replace(b, name=f"{b.name}{SEP}{field}", dtype=dtype))
        return tuple(out)

    def text(self) -> str:
        record = {
            "kind": self.kind,
            "form": self.form,
            "model_path": list(self.model_path),
            "dtypes": self.dtypes,
            "paths": self.paths,
            "extras": self.extras,
        }
        if self.weights or self.files:  # a DCP or torch.save record is as it always was
            record.update(weights=self.weights, files=self.files)
        return json.dumps(record, separators=(",", ":"), allow_nan=True)


def parse_optim(text: str, where: str, layout: Layout) -> OptimState:
    """The record in ``text``, checked against ``layout``."""
    try:
        d = json.loads(text)
        state = OptimState(
            kind=str(d["kind"]),
            form=str(d["form"]),
            model_path=tuple(d["model_path"]),
            dtypes={str(f): dict(v) for f, v in d["dtypes"].items()},
            paths={str(p): dict(v) for p, v in d["paths"].items()},
            extras=list(d["extras"]),
            weights={str(f): [str(n) for n in v] for f, v in d.get("weights", {}).items()},
            files={
                str(f): {"checksum": str(v["checksum"]), "base64": str(v["base64"])}
                for f, v in d.get("files", {}).items()
            },
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{where}: the optimizer metadata is damaged ({exc})") from None
    _check_folder_files(state, layout, where)
    entries = {e.name for b in layout.buffers for e in b.entries}
    stray = sorted(set(state.paths) - entries)
    if stray:
        raise CheckpointError(
            f"{where}: optimizer state for {stray[0]!r}, which no flat buffer holds; "
            "the metadata was modified"
        )
    for field, by_buffer in state.dtypes.items():
        for dtype in by_buffer.values():
            try:
                dtypes.canonical(str(dtype))
            except YafsdpError:
                raise CheckpointError(
                    f"{where}: state {field!r} has unknown dtype {dtype!r}"
                ) from None
    check_recorded_masters(state.dtypes, layout, where)
    return state


def _check_folder_files(state: OptimState, layout: Layout, where: str) -> None:
    """Names that ``restore`` writes into a folder are plain file names, each once,
    and each weights file stores tensors the layout holds."""
    names = [*state.weights, *state.files, *(["optimizer.pt"] if state.form == "trainer" else [])]
    for name in names:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(
                f"{where}: the optimizer metadata names a file {name!r}, which is no plain "
                "file name; the metadata was modified"
            )
    if len(set(names)) != len(names):
        raise CheckpointError(f"{where}: the optimizer metadata names a file twice")
    known = {n for b in layout.buffers for e in b.entries for n in e.names}
    known |= {n for t in layout.kept for n in t.names}
    for file, stored in state.weights.items():
        stray = next((n for n in stored if n not in known), None)
        if stray is not None or len(set(stored)) != len(stored):
            what = f"{stray!r}, which the layout does not hold" if stray else "a name twice"
            raise CheckpointError(f"{where}: {file} should store {what}; the metadata was modified")


def file_bytes(state: OptimState, where: str) -> dict[str, bytes]:
    """The carried files' bytes, each checked against its checksum."""
    out = {}
    for name, item in state.files.items():
        try:
            data = base64.b64decode(item["base64"], validate=True)
        except ValueError:
            data = None
        if data is None or checksum_of(data) != item["checksum"]:
            raise CheckpointError(
                f"{where}: the carried file {name} does not match its checksum; the metadata "
                "was modified or damaged"
            )
        out[name] = data
    return out


# ---------------------------------------------------------------- understanding a source


def optim_from(state: TrainingState, layout: Layout) -> OptimState:
    """The record for ``state`` (read from a source) in ``layout``, every check done
    before anything is written."""
    where = state.where
    fields: dict[str, set[str]] = {}
    for t in state.tensors:
        fields.setdefault(t.param, set()).add(t.field)
    for param, scalars in state.scalars.items():
        fields.setdefault(param, set()).update(scalars)
    kind = optimizer_kind(fields, where, counted_by_group(state.extras)) if fields else "none"
    check_steps({p: s["step"] for p, s in state.scalars.items() if "step" in s}, where)
    found = state_dtypes(state.tensors, layout, where)
    owner = {n: e.name for b in layout.buffers for e in b.entries for n in e.names}
    stateful = {owner[p] for p in fields if p in owner}
    check_masters(state.tensors, stateful, layout, where)
    refuse_param_copies(state.extras, layout, where)
    paths: dict[str, dict[str, list]] = {}
    for t in state.tensors:
        paths.setdefault(owner[t.param], {})[t.field] = path_json(t.path)
    return OptimState(
        kind=kind,
        form=state.form,
        model_path=tuple(state.model_path),
        dtypes=found,
        paths=paths,
        extras=[[path_json(path), encode(value)] for path, value in state.extras],
        weights={f: list(names) for f, names in state.weights.items()},
        files={
            name: {"checksum": checksum_of(data), "base64": base64.b64encode(data).decode()}
            for name, data in state.files.items()
        },
    )


def optimizer_kind(fields: dict[str, set[str]], where: str, group_steps: bool = False) -> str:
    """``"adam"`` or ``"sgd"`` from each parameter's state field names (tensors and
    scalars); refuses another optimizer by name and an incomplete Adam state.
    ``group_steps``: the param groups count the steps, so no parameter needs a ``step``."""
    seen = set().union(*fields.values()) if fields else set()
    masters = seen & set(MASTER_STATES)  # beside any optimizer's state (master_weights.py)
    seen -= masters
    for name in sorted(seen):
        if name in OTHER_OPTIMIZERS:
            raise CheckpointError(
                f"{where}: optimizer state field {name!r} belongs to {OTHER_OPTIMIZERS[name]}, "
                "which yafsdp does not carry (Adam, AdamW and SGD are understood); "
                "pass --weights-only to convert the weights alone"
            )
    if seen & set(ADAM_TENSORS):
        need = {"exp_avg", "exp_avg_sq", *([] if group_steps else ["step"])}
        allowed = {*ADAM_TENSORS, "step", *masters}
        kind = "adam"
    elif seen <= {*SGD_TENSORS}:
        need, allowed, kind = set(), {*SGD_TENSORS, *masters}, "sgd"
    else:
        raise CheckpointError(
            f"{where}: optimizer state with fields {sorted(seen)} is from an optimizer "
            "yafsdp does not know (Adam, AdamW and SGD are understood); "
            "pass --weights-only to convert the weights alone"
        )
    for param, have in fields.items():
        missing, extra = sorted(need - have), sorted(have - allowed)
        if missing or extra:
            what = f"no {missing[0]!r}" if missing else f"an unknown field {extra[0]!r}"
            raise CheckpointError(
                f"{where}: the {kind} state of {param!r} has {what} (it has {sorted(have)}); "
                "the optimizer state is incomplete or from another optimizer"
            )
    return kind


def counted_by_group(extras: Iterable[tuple[tuple, Any]]) -> bool:
    """Whether the param groups hold the step count, as Transformer Engine's
    ``FusedAdam`` keeps it (``group["step"]``) instead of one per parameter: a
    ``param_groups`` list whose dicts have ``step`` (``torch.save``), or its items
    saved one by one (``param_groups.0.step``, or ``param_groups.NAME.step``
    flattened) by ``dcp.save``."""
    for path, value in extras:
        last = str(path[-1]) if path else ""
        if last == "step" and "param_groups" in map(str, path[:-1]):
            return True
        if last.startswith("param_groups.") and last.endswith(".step"):
            return True
        groups = value if last == "param_groups" and isinstance(value, list) else []
        if any(isinstance(g, dict) and "step" in g for g in groups):
            return True
    return False


def check_steps(steps: dict[str, Any], where: str) -> None:
    """Every parameter's step count is the same (one step per flat buffer)."""
    values = {p: float(v) for p, v in steps.items()}
    if len(set(values.values())) > 1:
        (a, va), (b, vb) = _two_different(values)
        raise CheckpointError(
            f"{where}: the step count differs between parameters ({a!r}: {va:g}, "
            f"{b!r}: {vb:g}); a flat buffer's parameters take their steps together"
        )


def _two_different(values: dict[str, float]):
    items = list(values.items())
    first = items[0]
    return first, next(i for i in items if i[1] != first[1])


def state_dtypes(tensors: Iterable[StateTensor], layout: Layout, where: str) -> dict:
    """field -> buffer -> dtype; every state tensor has its parameter's shape and one
    dtype per (buffer, field)."""
    owner = {n: (b, e) for b in layout.buffers for e in b.entries for n in e.names}
    kept = {n for t in layout.kept for n in t.names}
    out: dict[str, dict[str, str]] = {}
    for t in tensors:
        if t.param not in owner:
            why = "is kept whole (not in a flat buffer)" if t.param in kept else "is no parameter"
            raise CheckpointError(
                f"{where}: optimizer state {t.field!r} of {t.param!r}, which {why}; convert "
                "every trained parameter into a buffer, or pass --weights-only"
            )
        b, e = owner[t.param]
        if tuple(t.shape) != tuple(e.shape):
            raise CheckpointError(
                f"{where}: state {t.field!r} of {t.param!r} has shape {list(t.shape)}, but the "
                f"parameter is {list(e.shape)}; the state does not match the model"
            )
        if t.field in MASTER_STATES:
            check_master_dtype(t.field, t.param, t.dtype, e.dtype, where)
        have = out.setdefault(t.field, {}).setdefault(b.name, t.dtype)
        if have != t.dtype:
            raise CheckpointError(
                f"{where}: state {t.field!r} of {t.param!r} is {t.dtype}, but other state "
                f"{t.field!r} of buffer {b.name} is {have}; one dtype per buffer is stored"
            )
    return out


# ---------------------------------------------------------------- values as JSON


def path_json(path) -> list:
    """A key path as JSON: strings (dict keys), ints (list indices) and
    ``{"key": n}`` for an integer dict key (``IntKey``)."""
    return [{"key": int(p)} if isinstance(p, IntKey) else p for p in path]


def path_of(path: list) -> tuple:
    return tuple(IntKey(p["key"]) if isinstance(p, dict) else p for p in path)


def encode(value: Any) -> Any:
    """A checkpoint's Python value (numbers, strings, tuples, lists, dicts, small
    tensors) as JSON that ``decode`` turns back into an equal value of the same type."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"f": repr(value)} if not math.isfinite(value) else value
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, RawTensor):  # read from a DCP folder without torch
        _check_value_bytes(len(value.data))
        return {"tensor": value.dtype, "shape": list(value.shape), "hex": value.data.hex()}
    if type(value).__name__ == "Tensor":  # torch is imported only by sources that hold one
        import torch

        t = value.detach().cpu().contiguous()
        _check_value_bytes(t.numel() * t.element_size())
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"tensor": dtypes.from_torch(t.dtype), "shape": list(t.shape), "hex": raw.hex()}
    raise CheckpointError(
        f"a checkpoint value of type {type(value).__name__} cannot be carried in the "
        "metadata; pass --weights-only to convert the weights alone"
    )


def _check_value_bytes(nbytes: int) -> None:
    if nbytes > MAX_VALUE_BYTES:
        raise CheckpointError(
            f"a {nbytes}-byte tensor that is neither a weight nor per-parameter optimizer "
            "state cannot be carried in the metadata; pass --weights-only to convert the "
            "weights alone"
        )


def decode(value: Any, *, raw: bool = False) -> Any:
    """The value ``encode`` was given; tensors as torch tensors, or with ``raw`` as
    ``RawTensor`` (for writers that do not import torch)."""
    if isinstance(value, list):
        return [decode(v, raw=raw) for v in value]
    if not isinstance(value, dict):
        return value
    if "f" in value:
        return float(value["f"])
    if "tuple" in value:
        return tuple(decode(v, raw=raw) for v in value["tuple"])
    if "dict" in value:
        return {decode(k, raw=raw): decode(v, raw=raw) for k, v in value["dict"]}
    if raw:
        dtype, shape = dtypes.canonical(value["tensor"]), tuple(value["shape"])
        data = bytes.fromhex(value["hex"])
        if len(data) != math.prod(shape) * dtypes.itemsize(dtype):
            raise CheckpointError(
                f"a {dtype}{list(shape)} tensor of the optimizer metadata holds {len(data)} "
                "bytes; the metadata is damaged"
            )
        return RawTensor(dtype, shape, data)
    import torch

    data = bytearray(bytes.fromhex(value["hex"]))
    dtype = dtypes.to_torch(value["tensor"])
    if not data:
        return torch.empty(value["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(value["shape"])
