"""The opcode check every pickle passes before it is unpickled (``pickle_guard``),
against unpickling the same bytes, on a DCP ``.metadata`` of 20,000 tensors.

    check  <= 3.0 x pickle.loads of the same bytes (C unpickler, stand-in classes)

The check walks every opcode in Python (``pickletools.genops``) with a stand-in
stack; the C unpickler is the floor: what reading the file costs without it. The
metadata is torch's own, written by ``dcp.save`` without a process group for 2,000
layers of 10 small tensors (about 4 MB, 2 million opcodes), once under
benchmarks/data/ (git-ignored). Each round times the check, ``pickle.loads`` with
the allow-list unpickler and ``read_dcp_metadata`` (check, load and every chunk
checked); medians of 5 rounds after a warm-up.
"""

from __future__ import annotations

import io
import statistics
import time
import warnings

from .common import DATA, verdict

LAYERS, PER_LAYER = 2000, 10
REPEAT = 5
BAR = 3.0


def make_metadata():
    folder = DATA / "pickle-guard-dcp"
    if not (folder / ".metadata").is_file():
        import torch
        import torch.distributed.checkpoint as dcp

        names = (f"model.layers.{i}.w{j}" for i in range(LAYERS) for j in range(PER_LAYER))
        state = {name: torch.zeros(2) for name in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> bool:
    from yafsdp_cli.sources.dcp_meta import read_dcp_metadata
    from yafsdp_cli.sources.dcp_pickle import MetadataUnpickler
    from yafsdp_cli.sources.pickle_guard import check_pickle

    DATA.mkdir(parents=True, exist_ok=True)
    folder = make_metadata()
    data = (folder / ".metadata").read_bytes()
    ops = check_pickle(data)
    print(f"pickle_guard: {len(data) / 1e6:.1f} MB .metadata, {ops} opcodes, median of {REPEAT}")
    runs = {"check": [], "loads": [], "read": []}
    for i in range(REPEAT + 1):
        check = _seconds(lambda: check_pickle(data))
        loads = _seconds(lambda: MetadataUnpickler(io.BytesIO(data), folder).load())
        read = _seconds(lambda: read_dcp_metadata(folder))
        if i:  # the first round warms the caches
            for key, value in zip(runs, (check, loads, read), strict=True):
                runs[key].append(value)
    check, loads, read = (statistics.median(runs[k]) for k in ("check", "loads", "read"))
    print(f"  check_pickle           {check:8.3f} s")
    print(f"  unpickle (floor)       {loads:8.3f} s")
    print(f"  read_dcp_metadata      {read:8.3f} s  (check + unpickle + every chunk checked)")
    return verdict("check / unpickle", check / loads, BAR, "x")
