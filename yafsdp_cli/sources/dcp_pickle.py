"""DCP's ``.metadata`` pickle, read and written without importing torch.

``torch.distributed.checkpoint`` pickles its ``Metadata`` dataclass: the dataclasses
of ``torch.distributed.checkpoint.metadata`` (as ``NEWOBJ`` + ``BUILD`` of their
``__dict__``; ``TensorProperties`` as a ``BUILD`` of the tuple its ``__getstate__``
gives), the ``_StorageInfo`` of the file system writer, ``torch.Size``, dtypes as the
globals ``torch.float32`` and so on, layouts through ``torch.serialization._get_layout``,
the ``_MEM_FORMAT_ENCODING`` enum, and a ``pathlib`` path. Importing torch to
resolve those names costs over a second, more than copying a checkpoint of a few GiB,
so ``MetadataUnpickler`` maps each of them onto the small stand-in class of the same
name below and refuses every other global (loading it could run code from the file).
``real_torch=True`` resolves the same allow-list to torch's own classes, for the
rare chunk that only torch's reader can read (``dcp_data.py``).

``dump_metadata`` writes stand-ins back under torch's names with a pure-Python
pickler that never imports the modules it names, so ``FileSystemReader.read_metadata``
(a plain ``pickle.load``) gets torch's own classes.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from typing import Any

from ..errors import SourceError, cut
from .torch_pickle import TORCH_DTYPES, Dtype, TorchNamePickler

DCP_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")


class MissingFieldError(AttributeError):
    """A record of the metadata lacks a field torch's class always has (an
    ``AttributeError``, so that ``getattr(record, name, default)`` still works)."""


class _Record:
    """A dataclass of torch's, as its pickle state: attributes from ``BUILD``'s dict,
    class attributes as the defaults of fields a pickle leaves out."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __getattr__(self, name: str):  # only for a name neither set nor defaulted
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingFieldError(f"a {type(self).__name__} record without its {name!r} field")

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({inner})"


class Metadata(_Record):
    state_dict_metadata: dict
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


class TensorStorageMetadata(_Record):
    properties: TensorProperties
    size: Size
    chunks: list


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: Size
    sizes: Size


class StorageMeta(_Record):
    checkpoint_id = None
    save_id = None
    load_id = None


class MetadataIndex(_Record):
    """A key of ``storage_data``: hashed as torch hashes it (``index`` is a hint)."""

    fqn: str
    offset = None
    index = None

    def _key(self):
        """``(fqn, offsets)``; a key of any other make is equal to itself only, so that
        hashing it while the pickle loads never walks what it holds (a tuple of tuples
        that share their parts costs exponential time to hash, and ``_storage_index``
        refuses such a key afterwards)."""
        fqn, offset = getattr(self, "fqn", None), getattr(self, "offset", None)
        if offset is not None:
            if not isinstance(offset, (tuple, list)) or not all(type(o) is int for o in offset):
                return (id(self),)
            offset = tuple(offset)
        return (fqn, offset) if type(fqn) is str else (id(self),)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._key() == self._key()


class _StorageInfo(_Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors = None

    def __getstate__(self):  # as torch's: fields that are None are left out
        return {k: v for k, v in self.__dict__.items() if v is not None}


class TensorProperties(_Record):
    """Pickled as the tuple (dtype, layout, requires_grad, memory format, pin_memory)."""

    def __init__(self, dtype: Dtype, layout: Layout | None = None):
        self.dtype = dtype
        self.layout = layout or Layout("torch.strided")
        self.requires_grad = False
        self.memory_format = _MEM_FORMAT_ENCODING(0)  # contiguous
        self.pin_memory = False

    def __getstate__(self):
        return (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory)

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError(f"tensor properties {state!r} are not torch's five fields")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class Size(tuple):
    """``torch.Size``: a tuple of ints."""

    def __reduce__(self):
        return (Size, (tuple(self),))


class Layout:
    """``torch.strided`` and the like, pickled through ``_get_layout(name)``."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_get_layout, (self.name,))

    def __eq__(self, other) -> bool:
        return type(other) is Layout and other.name == self.name

    def __repr__(self) -> str:
        return self.name


def _get_layout(name):
    return Layout(str(name))


class _MEM_FORMAT_ENCODING:  # noqa: N801 (torch's name, written into the pickle)
    """torch's enum of memory formats, by value (0 contiguous, 1 channels last, 2 preserve)."""

    def __init__(self, value):
        if value not in (0, 1, 2):
            raise ValueError(f"memory format encoding {value!r} is not 0, 1 or 2")
        self.value = value

    def __reduce__(self):
        return (_MEM_FORMAT_ENCODING, (self.value,))

    def __eq__(self, other) -> bool:
        return type(other) is _MEM_FORMAT_ENCODING and other.value == self.value

    def __repr__(self) -> str:
        return f"_MEM_FORMAT_ENCODING({self.value})"


# (module, name) in the pickle -> stand-in; the reverse names them when writing
_STAND_INS: dict[tuple[str, str], Any] = {
    (DCP_METADATA, c.__name__): c
    for c in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
    )
}
_STAND_INS[(_FILESYSTEM, "_StorageInfo")] = _StorageInfo
_STAND_INS[("torch.serialization", "_get_layout")] = _get_layout
_STAND_INS[("torch", "Size")] = Size
_TORCH_NAMES = {id(v): k for k, v in _STAND_INS.items()}


class MetadataUnpickler(pickle.Unpickler):
    """Loads only what a DCP metadata file holds, as stand-ins (or, with ``real_torch``,
    as torch's own classes); any other global is refused."""

    def __init__(self, file, where, *, real_torch: bool = False):
        super().__init__(file)
        self.where = where
        self.real_torch = real_torch

    def find_class(self, module: str, name: str):
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return getattr(pathlib, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        known = (module, name) in _STAND_INS or (module == "torch" and name in TORCH_DTYPES)
        if not known:
            raise SourceError(
                f"{self.where}: the metadata pickle names {cut(f'{module}.{name}')}, "
                "which a "
                "torch.distributed.checkpoint metadata file never holds; loading it could run "
                "code from the file, so it is refused"
            )
        if self.real_torch:
            return super().find_class(module, name)
        if module == "torch" and name in TORCH_DTYPES:
            return Dtype.named(name)
        return _STAND_INS[(module, name)]


def is_a(obj, name: str) -> bool:
    """``obj`` is DCP's metadata class ``name``, torch's own or its stand-in here (the
    unpickler admits no other class of these names)."""
    cls = type(obj)
    return cls.__name__ == name and cls.__module__ in (DCP_METADATA, __name__)


def dump_metadata(md: Metadata, file) -> None:
    """Pickle ``md`` (stand-ins) as torch's ``FileSystemWriter`` pickles its Metadata."""
    TorchNamePickler(file, pickle.DEFAULT_PROTOCOL, _TORCH_NAMES).dump(md)
