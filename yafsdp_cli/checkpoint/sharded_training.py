"""Training one rank of a ``ShardedFlat`` run from, and to, a flat checkpoint with
AdamW state.

Every rank calls both functions itself, with the same arguments; each is a
collective over the run's ``comm``, and when any rank fails every rank raises the
same one-line ``CheckpointError`` (the lowest failing rank's), so no rank is left
waiting in a collective the others never reach.

- ``sharded_adamw(sharded, ckpt)``: ``torch.optim.AdamW`` over this rank's shards
  (``ShardedFlat.shards``). With ``ckpt``, a flat checkpoint with AdamW state laid
  out for this world size (``yafsdp reshard -n N`` first), the rank reads its slice
  ``[rank * s, (rank + 1) * s)`` of every buffer and of its ``B@exp_avg`` and
  ``B@exp_avg_sq`` (``s`` the buffer's ``shard_numel``), the step counts and the
  hyperparameters of the record, and the kept tensors. A sharded set's rank checks
  and reads its own file alone; a single file is checked whole by every rank. With
  ``masters=True`` it is a ``MasterAdamW`` over float32 masters of the shards, and a
  checkpoint's ``B@master_param`` is sliced like the rest.
- ``save_sharded_training(sharded, opt, out)``: a sharded set in folder ``out``.
  Rank 0 checks ``out``, takes its lock and makes a hidden temporary folder beside
  it (``writer.Staged``); each rank writes its own rank file there; rank 0 checks
  that the ranks agree (optimizer record, kept tensors), writes the index from
  every rank's checksums and renames the folder to ``out``. So ``out`` appears
  whole or not at all: a rank that dies leaves only the hidden temporary. Every
  rank must see ``out``'s file system.

Slicing the state is exact: AdamW is elementwise, so AdamW over a rank's shard
equals that slice of AdamW over the whole buffer bit for bit (for-loop and foreach,
float32 and bfloat16 on CPU: ``tests/checkpoint/test_resume_ranks.py``). Padding stays zero:
its gradient is zero, so its weight and state stay zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ..engine.sharded import ShardedFlat
from ..errors import CheckpointError, YafsdpError
from ..fileio import write_error
from .flat_training import (
    adamw_extras,
    adamw_record,
    load_adamw,
    load_kept,
    master_dtypes,
    new_adamw,
    opened,
    read_buffer,
    refuse_kept,
    tensor_bytes,
    training_tensors,
)
from .flat_writer import base_metadata, stored_kept, write_index, write_rank_file
from .reader import FlatCheckpoint
from .results import WrittenFile
from .writer import Staged, check_flat_name, check_output

T = TypeVar("T")
SOURCE = "sharded_adamw"  # the source recorded in the checkpoint's metadata


def sharded_adamw(
    sharded: ShardedFlat,
    ckpt: str | Path | FlatCheckpoint | None = None,
    *,
    masters: bool = False,
    **hyper,
) -> torch.optim.AdamW:
    """AdamW over ``sharded.shards``; with ``ckpt`` (the module converted with
    ``open_flat(ckpt).layout``), this rank's part of its weights and state loaded.
    ``masters``: float32 masters of the shards narrower than float32 (as ``flat_adamw``).
    ``hyper`` are AdamW's keywords; a checkpoint's own hyperparameters win."""
    refuse_kept(sharded.kept_parameters())
    pairs = _pairs(sharded)
    if ckpt is None:
        return new_adamw(pairs, master_dtypes(pairs, None, masters), hyper)
    made: list[torch.optim.AdamW] = []
    _together(sharded, lambda: made.append(_load(sharded, ckpt, masters, hyper)))
    return made[0]


def _load(sharded: ShardedFlat, ckpt, masters: bool, hyper: dict) -> torch.optim.AdamW:
    ckpt = opened(ckpt)
    adamw_extras(ckpt)  # no AdamW state: say so before anything else
    pairs = _pairs(sharded)
    opt = new_adamw(pairs, master_dtypes(pairs, ckpt, masters), hyper)
    rank, world = sharded.comm.rank, sharded.comm.world_size
    if ckpt.layout.world_size != world:
        raise CheckpointError(
            f"{ckpt.root} is laid out for {ckpt.layout.world_size} ranks, but {world} "
            f"run; reshard it first: yafsdp reshard {ckpt.root} -n {world} --sharded -o NEW"
        )
    ckpt.verify(ranks=[rank] if ckpt.sharded else None)
    load_adamw(opt, ckpt, pairs, lambda stored: _rank_slice(ckpt, stored, rank))
    load_kept(sharded.module, ckpt)
    return opt


def _rank_slice(ckpt: FlatCheckpoint, stored, rank: int) -> torch.Tensor:
    s = stored.shard_numel
    return read_buffer(ckpt, stored, rank * s, (rank + 1) * s)  # (s,)


def _pairs(sharded: ShardedFlat) -> list:
    return [(b.layout, shard) for b, shard in zip(sharded.flat.buffers, sharded.shards)]


def save_sharded_training(
    sharded: ShardedFlat, opt: torch.optim.Optimizer, out: str | Path
) -> None:
    """Write this rank's file of the sharded set ``out`` (a new folder); rank 0 also
    writes the index and puts the set in place. Call it on every rank."""
    out, comm = Path(out), sharded.comm
    if comm.simulated and comm.world_size > 1:
        raise CheckpointError(
            f"rank {comm.rank} of {comm.world_size} simulated in one process (LocalComm): "
            "a sharded set needs every rank's file; save from ranks with DistComm"
        )
    staged: list[Staged] = []  # rank 0's temporary folder
    try:
        first = _together(sharded, lambda: _prepare(sharded, opt, out, staged))
        meta = _agreed_metadata([m for m, _ in first])
        temp = Path(first[0][1])
        files = _together(sharded, lambda: _write_mine(sharded, opt, temp, meta, out))
        _together(sharded, lambda: _commit(sharded, staged, files, meta))
    finally:
        for s in staged:
            s.close()


def _prepare(sharded: ShardedFlat, opt, out: Path, staged: list[Staged]):
    """This rank's metadata; rank 0 also checks ``out`` and makes the temporary."""
    check_flat_name(out, sharded=True)
    layout = sharded.flat.layout
    if layout.world_size != sharded.comm.world_size:
        raise CheckpointError(
            f"the module's layout is for {layout.world_size} ranks, but "
            f"{sharded.comm.world_size} run; plan it for this world size"
        )
    if sharded.comm.rank == 0:
        check_output(out, inputs=[], force=False, folder=True)
    meta = base_metadata(layout, SOURCE, {}, adamw_record(_pairs(sharded), opt))
    if sharded.comm.rank != 0:
        return meta, None
    staged.append(Staged(out, folder=True))
    _safely(out, staged[0].open)  # the output's lock, and the temporary folder
    return meta, str(staged[0].temp)


def _agreed_metadata(metas: list[dict]) -> dict:
    for r, meta in enumerate(metas[1:], start=1):
        if meta != metas[0]:
            raise CheckpointError(
                f"rank {r}'s optimizer record differs from rank 0's (step counts or "
                "hyperparameters); every rank must step the same optimizer the same times"
            )
    return metas[0]


def _write_mine(sharded: ShardedFlat, opt, temp: Path, meta: dict, out: Path) -> WrittenFile:
    tensors = training_tensors(_pairs(sharded), opt)
    state = sharded.module.state_dict()

    def pieces(name: str) -> list:
        return [tensor_bytes(tensors[name] if name in tensors else state[name])]

    layout, rank = sharded.flat.layout, sharded.comm.rank
    optim = adamw_record(_pairs(sharded), opt)
    return _safely(out, lambda: write_rank_file(temp, layout, rank, pieces, meta, optim))


def _commit(sharded: ShardedFlat, staged: list[Staged], files: list[WrittenFile], meta) -> None:
    if sharded.comm.rank != 0:
        return
    _check_replicas(sharded, files)
    _safely(staged[0].out, lambda: write_index(staged[0].temp, sharded.flat.layout, files, meta))
    _safely(staged[0].out, staged[0].commit)


def _check_replicas(sharded: ShardedFlat, files: list[WrittenFile]) -> None:
    """Kept tensors are whole on every rank; the set holds one copy's checksum."""
    for t in stored_kept(sharded.flat.layout):
        for f in files[1:]:
            if f.checksums[t.name] != files[0].checksums[t.name]:
                raise CheckpointError(
                    f"kept tensor {t.name!r} differs between rank 0 and rank {f.rank}; "
                    "every rank must hold the same copy (broadcast it from rank 0 first)"
                )


def _safely(out: Path, work: Callable[[], T]) -> T:
    try:
        return work()
    except OSError as exc:  # disk full, read-only folder: one line naming the output
        raise write_error(exc, out, CheckpointError) from None


def _together(sharded: ShardedFlat, work: Callable[[], T]) -> list[T]:
    """``work()`` on this rank, then every rank's result in rank order; if a rank
    failed, every rank raises the lowest failing rank's error."""
    try:
        mine = (None, work())
    except YafsdpError as exc:
        mine = (str(exc), None)
    every = _all_gather(sharded.comm, mine)
    for r, (error, _) in enumerate(every):
        if error is not None:
            raise CheckpointError(error if len(every) == 1 else f"rank {r}: {error}")
    return [value for _, value in every]


def _all_gather(comm, obj) -> list:
    if comm.world_size == 1 or comm.simulated:  # alone (LocalComm): nobody to wait for
        return [obj]
    every = [None] * comm.world_size
    comm.dist.all_gather_object(every, obj, group=comm.group)
    return every
