"""The device mesh: named dimensions, their product, and what today's figures know."""

from __future__ import annotations

import pickle

import pytest

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.mesh import DIMENSIONS, Mesh


def test_a_mesh_defaults_to_one_rank():
    mesh = Mesh()
    assert mesh.world_size == 1 and mesh.shard == 1
    assert mesh.used == () and mesh.label == "1 rank" and mesh.data_parallel_only


def test_data_parallel_shards_over_every_rank():
    mesh = Mesh.data_parallel(8)
    assert mesh == Mesh(dp_shard=8)
    assert (mesh.world_size, mesh.shard, mesh.label) == (8, 8, "dp_shard=8")
    assert mesh.data_parallel_only


def test_the_world_size_is_the_product_but_ep():
    mesh = Mesh(dp_replicate=2, dp_shard=4, cp=2, tp=2, pp=3, ep=8)
    assert mesh.world_size == 2 * 4 * 2 * 2 * 3  # ep is carved out of dp_shard * cp
    assert mesh.shard == 4
    assert mesh.label == "dp_replicate=2 x dp_shard=4 x cp=2 x tp=2 x pp=3 x ep=8"
    assert not mesh.data_parallel_only
    assert mesh.sizes == (2, 4, 2, 2, 3, 8)
    assert DIMENSIONS == ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@pytest.mark.parametrize("dim", DIMENSIONS)
@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2", None])
def test_every_dimension_is_a_whole_number_of_at_least_one(dim, bad):
    with pytest.raises(YafsdpError, match=dim):
        Mesh(**{dim: bad})


def test_ep_must_divide_dp_shard_times_cp():
    assert Mesh(dp_shard=4, cp=2, ep=8).world_size == 8
    with pytest.raises(YafsdpError, match="ep=3 must divide"):
        Mesh(dp_shard=4, ep=3)


def test_a_mesh_is_frozen_hashable_and_pickles():
    mesh = Mesh(dp_replicate=2, dp_shard=4)
    with pytest.raises(AttributeError):
        mesh.dp_shard = 2  # type: ignore[misc]
    assert {mesh: 1}[Mesh(dp_replicate=2, dp_shard=4)] == 1
    assert pickle.loads(pickle.dumps(mesh)) == mesh


def test_the_mesh_imports_no_torch():
    import ast
    from pathlib import Path

    import yafsdp_cli.mesh as module

    tree = ast.parse(Path(module.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any("torch" in (n or "") for n in names)
