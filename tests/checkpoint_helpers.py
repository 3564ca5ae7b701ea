"""Helpers for the checkpoint tests: bit-exact comparison and header surgery."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import torch
from conftest import SAMPLES
from safetensors.torch import load_file


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (NaN payloads and signed zeros included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensors(a: dict, b: dict) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        ta, tb = a[name], b[name]
        assert (ta.dtype, ta.shape) == (tb.dtype, tb.shape), name
        assert raw(ta) == raw(tb), f"{name}: bytes differ"


def sample(name: str) -> Path:
    return SAMPLES / name


def load_st(path: Path) -> dict:
    return load_file(str(path))


def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + data)


def crc(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def tensor_bytes(header: dict, data: bytes, name: str) -> bytes:
    a, z = header[name]["data_offsets"]
    return data[a:z]


def reseal(header: dict, data: bytes) -> dict:
    """Recompute every tensor checksum in the metadata (a forger's edit)."""
    meta = header["__metadata__"]
    sums = json.loads(meta["yafsdp.checksums"])
    for name in sums:
        sums[name] = crc(tensor_bytes(header, data, name))
    meta["yafsdp.checksums"] = json.dumps(sums, separators=(",", ":"))
    return header


def file_system_can(folder: Path, try_it) -> bool:
    """Whether ``try_it(path)`` succeeds on a new empty file in ``folder`` (an
    ``OSError`` means no): what a test skips on where the file system lacks it."""
    probe = folder / "file-system-probe"
    probe.write_bytes(b"")
    try:
        try_it(probe)
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def train_steps(model, opt, first: int, steps: int) -> list[float]:
    """Seeded steps ``first .. first + steps - 1``; the loss of each."""
    from yafsdp_cli.engine.inputs import make_input, projection_loss

    losses = []
    for step in range(first, first + steps):
        loss = projection_loss(model(make_input(model, seed=step)), seed=step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
