"""``data.pkl`` of a ``torch.save`` archive, read and written without importing torch.

``torch.save`` pickles a tensor as a call ``torch._utils._rebuild_tensor_v2(storage,
storage_offset, size, stride, requires_grad, backward_hooks)`` (``_v3`` with a trailing
dtype for dtypes without a legacy storage class, such as float8), where ``storage`` is
a persistent id ``("storage", torch.FloatStorage, key, location, numel)`` naming the
archive member ``data/KEY`` that holds its bytes. ``TensorUnpickler`` turns exactly
those globals (and ``collections.OrderedDict``, the empty backward hooks) into a
``TensorRef``; any other global raises ``NeedsTorchError`` and is left to
``torch.load(weights_only=True)``, which reads what it allows and refuses the rest, as
before. ``tensor_pickle`` writes the same calls for a ``RawTensor`` (what torch writes:
``tests/sources/test_torch_archive.py`` compares the bytes).

``TorchNamePickler`` is the pure-Python pickler with one change: objects registered in
its ``names`` (stand-ins for torch's classes and functions) are written as the global
of that name without importing its module.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import types
from dataclasses import dataclass
from typing import Any

from ..engine import dtypes
from .pickle_guard import check_pickle
from .torch_archive import NeedsTorchError

# Every dtype name torch exposes (tests/sources/test_torch_archive.py checks the installed torch)
TORCH_DTYPES = frozenset(
    (
        "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex32",
        "chalf", "complex64", "cfloat", "complex128", "cdouble", "uint8", "uint16", "uint32",
        "uint64", "int8", "int16", "short", "int32", "int", "int64", "long", "bool", "quint8",
        "qint8", "qint32", "quint4x2", "quint2x4", "float8_e4m3fn", "float8_e4m3fnuz",
        "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bit", "bits1x8",
        "bits2x4", "bits4x2", "bits8", "bits16", "int1", "int2", "int3", "int4", "int5", "int6",
        "int7", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    )
)  # fmt: skip
# torch's legacy storage classes; other dtypes are saved as UntypedStorage + dtype (v3)
LEGACY_STORAGES = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
}
PICKLE_PROTOCOL = 2  # torch.save's default


class Dtype:
    """``torch.float32`` and the like, as a pickle names them; ``str`` as torch prints."""

    _all: dict[str, Dtype] = {}

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def named(cls, name: str) -> Dtype:
        return cls._all.setdefault(name, cls(name))

    def __reduce__(self):
        return self.name  # pickled as the global torch.<name>, as torch.dtype is

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


class TorchNamePickler(pickle._Pickler):  # the pure-Python pickler: its save_global is ours
    """Writes each object of ``names`` (by identity) as the global ``(module, name)``,
    and a ``Dtype`` as ``torch.<name>``, without importing the modules named."""

    dispatch = dict(pickle._Pickler.dispatch)  # functions, too, go through our save_global
    dispatch[types.FunctionType] = lambda self, obj: self.save_global(obj)

    def __init__(self, file, protocol: int, names: dict[int, tuple[str, str]]):
        super().__init__(file, protocol)
        self.names = names

    def save_global(self, obj, name=None) -> None:
        where = self.names.get(id(obj))
        if where is None and isinstance(obj, Dtype):
            where = ("torch", obj.name)
        if where is None:
            super().save_global(obj, name)
            return
        module, qualname = where
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


# ---------------------------------------------------------------- tensors


@dataclass(frozen=True)
class RawTensor:
    """A small tensor held as its bytes (a step count, a scheduler's value)."""

    dtype: str  # canonical name
    shape: tuple[int, ...]
    data: bytes  # row-major, little-endian

    def __float__(self) -> float:
        if math.prod(self.shape) != 1:
            raise ValueError(f"a {list(self.shape)} tensor is not one number")
        if self.dtype == "bfloat16":
            return struct.unpack("<f", b"\0\0" + self.data)[0]
        code = {"float64": "d", "float32": "f", "float16": "e", "int64": "q", "int32": "i",
                "int16": "h", "int8": "b", "uint8": "B", "bool": "?"}.get(self.dtype)  # fmt: skip
        if code is None:
            raise ValueError(f"a {self.dtype} tensor is read as a number by torch only")
        return float(struct.unpack("<" + code, self.data)[0])


@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str  # its archive member is data/KEY
    dtype: str | None  # None for an UntypedStorage (the tensor says)
    numel: int  # elements (bytes for an UntypedStorage)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor in data.pkl: a view of a storage."""

    storage: StorageRef
    offset: int  # elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def byte_range(self, storage_bytes: int) -> tuple[int, int]:
        """(start, nbytes) of the tensor's bytes in its storage member; ``NeedsTorchError``
        unless they are one contiguous row-major run (torch's reader handles the rest)."""
        isz = dtypes.itemsize(self.dtype)
        if not math.prod(self.shape):
            return 0, 0  # no bytes, whatever the strides say
        expect = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expect:
                raise NeedsTorchError("a non-contiguous tensor")
            expect *= size
        nbytes = math.prod(self.shape) * isz
        start = self.offset * isz
        if start + nbytes > storage_bytes:
            raise NeedsTorchError("a view past its storage")
        return start, nbytes


def _ints(v, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int and x >= 0 for x in v):
        raise NeedsTorchError(f"{v!r} is not a tuple of sizes")
    if n is not None and len(v) != n:
        raise NeedsTorchError("size and stride of different lengths")
    return v


def _rebuild(storage, offset, size, stride, requires_grad, hooks, dtype=None, metadata=None):
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise NeedsTorchError("a tensor rebuilt from something other than a storage")
    if hooks or metadata or not isinstance(requires_grad, bool):
        raise NeedsTorchError("a tensor with hooks or metadata")
    name = storage.dtype if dtype is None else getattr(dtype, "name", None)
    if name is None or storage.dtype not in (None, name):
        raise NeedsTorchError("a tensor whose dtype its storage does not give")
    try:
        canonical = dtypes.canonical(name)
    except Exception:
        raise NeedsTorchError(f"dtype {name}") from None
    shape = _ints(size)
    return TensorRef(storage, offset, shape, _ints(stride, len(shape)), canonical)


def _rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    return _rebuild(storage, offset, size, stride, requires_grad, hooks, None, metadata)


def _rebuild_parameter(data, requires_grad, hooks):
    if not isinstance(data, TensorRef) or hooks:
        raise NeedsTorchError("a parameter with hooks")
    return data


class _StorageType:
    """torch's ``FloatStorage`` and the like, by the dtype it gives."""

    def __init__(self, name: str, dtype: str | None):
        self.name, self.dtype = name, dtype

    def __reduce__(self):
        return self.name  # written as a global (``TorchNamePickler`` knows its module)


_STORAGE_TYPES = {name: _StorageType(name, dtype) for dtype, name in LEGACY_STORAGES.items()}
_UNTYPED = _StorageType("UntypedStorage", None)
_READ = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    **{("torch", name): t for name, t in _STORAGE_TYPES.items()},
}


class TensorUnpickler(pickle.Unpickler):
    """data.pkl with ``TensorRef`` for each tensor; ``NeedsTorchError`` for any global other
    than torch.save's own for plain tensors."""

    def find_class(self, module: str, name: str):
        found = _READ.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in TORCH_DTYPES:
            return Dtype.named(name)
        raise NeedsTorchError(f"the pickle names {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NeedsTorchError(f"persistent id {pid!r}")
        _, kind, key, location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str):
            raise NeedsTorchError(f"storage {pid!r}")
        if not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise NeedsTorchError(f"storage {pid!r}")
        return StorageRef(key, kind.dtype, numel)


def load_pickle(data: bytes) -> Any:
    """data.pkl's object, tensors as ``TensorRef``. ``NeedsTorchError`` for what only torch
    reads; any other error is the pickle's damage (``pickle_guard.PickleShapeError``
    for one no unpickler is given)."""
    check_pickle(data)
    return TensorUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------- writing


def _write_rebuild_v2(*args):  # the names torch.save writes; never called here
    raise AssertionError("a stand-in for torch._utils._rebuild_tensor_v2")


def _write_rebuild_v3(*args):
    raise AssertionError("a stand-in for torch._utils._rebuild_tensor_v3")


_WRITE_NAMES = {
    id(_write_rebuild_v2): ("torch._utils", "_rebuild_tensor_v2"),
    id(_write_rebuild_v3): ("torch._utils", "_rebuild_tensor_v3"),
    id(_UNTYPED): ("torch.storage", "UntypedStorage"),
    **{id(t): ("torch", name) for name, t in _STORAGE_TYPES.items()},
}


class _StorageOut:
    def __init__(self, key: str, kind: _StorageType, numel: int):
        self.pid = ("storage", kind, key, "cpu", numel)


class _TensorOut:
    """A tensor to pickle as torch.save does: a whole contiguous storage of its own."""

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...]):
        numel = math.prod(shape)
        legacy = LEGACY_STORAGES.get(dtype)
        kind = _STORAGE_TYPES[legacy] if legacy else _UNTYPED
        count = numel if legacy else numel * dtypes.itemsize(dtype)
        self.storage = _StorageOut(key, kind, count)
        self.dtype, self.shape = dtype, tuple(shape)
        stride, s = [], 1
        for d in reversed(self.shape):
            stride.append(s)
            s *= d
        self.stride = tuple(reversed(stride))

    def reduce(self):
        args = (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict())
        if LEGACY_STORAGES.get(self.dtype):
            return (_write_rebuild_v2, args)
        return (_write_rebuild_v3, (*args, Dtype.named(self.dtype)))


class _DataPickler(TorchNamePickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageOut) else None

    def reducer_override(self, obj):
        if isinstance(obj, _TensorOut):
            return obj.reduce()
        return NotImplemented


def tensor_pickle(value: Any, tensors: dict[int, tuple[str, tuple[int, ...]]]) -> bytes:
    """data.pkl for ``value``, in which each object whose id is in ``tensors`` is a
    tensor ``(dtype, shape)`` stored in member ``data/K`` (K its order of appearance
    in ``tensors``)."""
    keys = {oid: str(k) for k, oid in enumerate(tensors)}
    outs = {oid: _TensorOut(keys[oid], *spec) for oid, spec in tensors.items()}

    def swap(v):
        if id(v) in outs:
            return outs[id(v)]
        if isinstance(v, list):
            return [swap(x) for x in v]
        if isinstance(v, tuple):
            return tuple(swap(x) for x in v)
        if isinstance(v, dict):
            return {swap(k): swap(x) for k, x in v.items()}
        return v

    buf = io.BytesIO()
    _DataPickler(buf, PICKLE_PROTOCOL, _WRITE_NAMES).dump(swap(value))
    return buf.getvalue()
