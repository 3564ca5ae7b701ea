"""The parts of GPU memory beside the step's tensors: each follows its rule, each takes
an override, and a bad variable is one line naming it."""

from __future__ import annotations

import doctest

import pytest

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.memory import outside_memory
from yafsdp_cli.memory.outside_allocator import (
    CONTEXT_EAGER,
    CONTEXT_MEASURED,
    parse_cublas_config,
    torch_minor,
)

MIB, KIB = 1 << 20, 1 << 10


def parts(**kw) -> dict[str, int]:
    kw.setdefault("torch_version", "2.11.0+cu130")
    kw.setdefault("env", {})
    return {p.name: p.bytes for p in outside_memory(**kw).parts}


def test_the_docstring_runs():
    import yafsdp_cli.memory.outside_allocator as mod

    assert doctest.testmod(mod).failed == 0


def test_total_is_the_sum_of_the_parts():
    out = outside_memory(torch_version="2.11.0", world_size=4, env={})
    assert out.total == sum(p.bytes for p in out.parts) > 0
    assert all(p.source for p in out.parts)


def test_context_is_the_measured_figure_of_the_release():
    got = outside_memory(torch_version="2.11.0+cu130", env={}).parts[0]
    assert got.bytes == CONTEXT_MEASURED[(2, 11)][0] == 804_061_184
    assert "measured" in got.source and "not measured" not in got.source


def test_context_of_an_unmeasured_release_says_whose_figure_it_is():
    got = outside_memory(torch_version="2.4.1", env={}).parts[0]
    assert got.bytes == CONTEXT_MEASURED[(2, 11)][0]
    assert got.source.startswith("torch 2.4 not measured; torch 2.11's")


def test_eager_module_loading_has_its_own_context():
    got = parts(env={"CUDA_MODULE_LOADING": "EAGER"})
    assert got["CUDA context"] == CONTEXT_EAGER[(2, 11)][0]


def test_cublas_default_is_32_mib_on_hopper_per_handle():
    assert parts(capability=(9, 0))["cuBLAS workspaces"] == 2 * 32 * MIB


def test_cublas_default_elsewhere_is_4096_2_16_8():
    assert parts(capability=(8, 0))["cuBLAS workspaces"] == 2 * (8 * MIB + 128 * KIB)


def test_cublas_config_replaces_the_default():
    got = parts(env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2"})
    assert got["cuBLAS workspaces"] == 2 * 8 * MIB  # measured: 8 MiB each on the H200
    assert parse_cublas_config(":128:8:64:16:32:32") == 3072 * KIB  # torch's own test


@pytest.mark.parametrize("bad", ["4096:8", ":4096", "-1", ":a:2"])
def test_a_bad_cublas_config_is_one_line(bad):
    with pytest.raises(YafsdpError, match="CUBLAS_WORKSPACE_CONFIG=.*SIZE:COUNT"):
        parts(env={"CUBLAS_WORKSPACE_CONFIG": bad})


def test_cublaslt_default_size_and_variable():
    assert parts()["cuBLASLt workspaces"] == MIB
    assert parts(env={"CUBLASLT_WORKSPACE_SIZE": "2048"})["cuBLASLt workspaces"] == 2 * MIB
    unified = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}
    assert parts(env=unified)["cuBLASLt workspaces"] == 0


def test_a_bad_cublaslt_size_is_one_line():
    with pytest.raises(YafsdpError, match="CUBLASLT_WORKSPACE_SIZE='big' is not a whole number"):
        parts(env={"CUBLASLT_WORKSPACE_SIZE": "big"})


@pytest.mark.parametrize("world, peers", [(1, 0), (2, 1), (3, 2), (256, 2)])
def test_nccl_is_buffsize_times_channels_times_ring_peers(world, peers):
    assert parts(world_size=world)["NCCL buffers"] == 4 * MIB * 16 * peers


def test_nccl_variables():
    env = {"NCCL_BUFFSIZE": str(MIB), "NCCL_MAX_NCHANNELS": "8"}
    assert parts(world_size=8, env=env)["NCCL buffers"] == MIB * 8 * 2
    env = {"NCCL_MIN_NCHANNELS": "32"}
    assert parts(world_size=8, env=env)["NCCL buffers"] == 4 * MIB * 32 * 2


@pytest.mark.parametrize("name", ["NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"])
def test_a_bad_nccl_variable_is_one_line(name):
    with pytest.raises(YafsdpError, match=f"{name}='-4' is not a whole number"):
        parts(world_size=8, env={name: "-4"})


def test_every_part_takes_an_override():
    got = outside_memory(
        torch_version="2.11", world_size=8, env={}, context=1, cublas=2, cublaslt=3, nccl=4
    )
    assert [(p.bytes, p.source) for p in got.parts] == [(n, "given") for n in (1, 2, 3, 4)]
    assert got.total == 10


def test_an_override_wins_over_a_bad_variable_it_replaces():
    got = parts(env={"NCCL_BUFFSIZE": "x"}, world_size=8, nccl=5)
    assert got["NCCL buffers"] == 5


def test_a_negative_override_is_refused():
    with pytest.raises(YafsdpError, match="NCCL buffers: bytes must not be negative"):
        outside_memory(torch_version="2.11", env={}, nccl=-1)


def test_torch_version_is_read_or_refused():
    assert torch_minor("2.11.0+cu130") == (2, 11)
    with pytest.raises(YafsdpError, match="torch version 'nightly' is not MAJOR.MINOR"):
        outside_memory(torch_version="nightly", env={})
