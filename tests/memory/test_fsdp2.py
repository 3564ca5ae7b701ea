"""FSDP2's placement in the memory model: torch.chunk's rules against torch itself,
figures by hand, the uneven-split warning and its remedy, and the CLI.

Real FSDP2 on gloo is in ``test_fsdp2_truth.py``; these need no processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from torch.distributed.tensor import Shard
from typer.testing import CliRunner

from tests.inspection.test_inspect import SCHEMA
from yafsdp_cli import ModelSpec, TensorRecord, YafsdpError, plan
from yafsdp_cli.cli import app
from yafsdp_cli.memory import MemoryConfig, estimate_memory, persistent_by_rank, rank_groups
from yafsdp_cli.memory.fsdp2 import (
    chunk_split,
    fsdp2_memory,
    glob_names,
    place,
    placement_fn_line,
    uneven_on_dim0,
)
from yafsdp_cli.options import LayoutOptions

runner = CliRunner()
EXACT = MemoryConfig(round_bytes=1)


def owned(split, rank: int) -> int:
    return split.full if rank < split.k else split.rest if rank == split.k else 0


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    world=st.integers(1, 16),
    dim=st.integers(0, 2),
)
def test_chunk_split_is_what_fsdp2_chunks(shape, world, dim):
    """Against FSDP2's own helper: rank r owns chunks[r], every rank allocates chunks[0]."""
    dim = min(dim, len(shape) - 1)
    chunks = _chunk_with_empty(torch.empty(shape), world, dim=dim)
    split = chunk_split(shape, dim, world)
    assert split.padded == chunks[0].numel()
    assert [owned(split, r) for r in range(world)] == [c.numel() for c in chunks]


def spec(*tensors: tuple[str, tuple[int, ...], str], frozen: bool = False) -> ModelSpec:
    records = tuple(TensorRecord(n, s, d, requires_grad=not frozen) for n, s, d in tensors)
    units = tuple(sorted({".".join(n.split(".")[:2]) for n, _, _ in tensors if n[0] == "l"}))
    return ModelSpec(records, has_architecture=False, units=units, module_names=units)


EXPERTS = spec(
    ("layers.0.experts", (4, 8, 16), "float32"),
    ("layers.1.experts", (4, 8, 16), "float32"),
    ("head", (96, 16), "float32"),
)


def test_experts_over_eight_ranks_by_hand():
    """4 experts of 128 elements: every rank allocates one expert per parameter and
    gradient; ranks 0-3 hold one expert of AdamW states, ranks 4-7 none."""
    groups = rank_groups(plan(EXPERTS, LayoutOptions(world_size=8)), EXACT)
    head = 12 * 16 * 4  # 96 rows / 8 = 12 rows of 16 fp32
    expert = 128 * 4
    assert [g.ranks for g in groups] == [(0, 3), (4, 7)]
    first, last = groups
    assert first.params == first.grads == last.params == 2 * expert + head
    assert first.optimizer == 2 * (2 * expert + head)
    assert last.optimizer == 2 * head
    assert (
        persistent_by_rank(plan(EXPERTS, LayoutOptions(world_size=8)), EXACT)
        == (first.persistent,) * 4 + (last.persistent,) * 4
    )


def test_auto_placement_puts_experts_on_dim_1():
    layout = plan(EXPERTS, LayoutOptions(world_size=8))
    auto = fsdp2_memory(layout, EXACT, "auto")
    assert len(auto.ranks) == 1  # every rank alike
    assert {p.name: p.dim for p in place(layout, EXACT, "auto")} == {
        "layers.0.experts": 1,
        "layers.1.experts": 1,
        "head": 0,
    }
    u = auto.uneven  # the warning is about the default placement, whichever is modeled
    assert u is not None and u.params == ("layers.*.experts",)
    assert u.dim1_bytes == auto.fullest.persistent < u.fullest_bytes
    assert u.fullest_bytes == fsdp2_memory(layout, EXACT, "dim0").fullest.persistent
    assert u.shard_placement_fn == (
        "shard_placement_fn=lambda p: Shard(1) if tuple(p.shape) in {(4, 8, 16)} else None"
    )


def test_the_placement_line_picks_exactly_its_shapes():
    line = placement_fn_line([(4, 8, 16), (4, 16)])
    fn = eval(line.removeprefix("shard_placement_fn="), {"Shard": Shard})  # noqa: S307
    assert fn(torch.nn.Parameter(torch.empty(4, 8, 16))) == Shard(1)
    assert fn(torch.nn.Parameter(torch.empty(4, 16))) == Shard(1)
    assert fn(torch.nn.Parameter(torch.empty(8, 4, 16))) is None
    assert placement_fn_line([]) == ""


def test_no_shard_1_where_dim_1_does_not_divide():
    layout = plan(spec(("layers.0.experts", (4, 6, 16), "float32")), LayoutOptions(world_size=8))
    u = fsdp2_memory(layout, EXACT, "auto").uneven
    assert u is not None and u.stuck_params == ("layers.*.experts",) and not u.dim1_params
    assert u.shard_placement_fn == "" and u.dim1_bytes == u.fullest_bytes


@pytest.mark.parametrize(
    ("rows", "world", "uneven"),
    [(4, 8, True), (64, 8, False), (61, 8, False), (59, 8, True), (7, 1, False), (0, 4, False)],
)
def test_uneven_means_more_than_five_percent_of_padding(rows, world, uneven):
    # 61 -> 64 rows is 4.9% more; 59 -> 64 is 8.5%
    assert uneven_on_dim0((rows, 3), world) is uneven


def test_a_dense_model_gets_no_warning():
    dense = spec(("layers.0.w", (64, 16), "float32"), ("head", (61, 16), "float32"))
    m = fsdp2_memory(plan(dense, LayoutOptions(world_size=8)), EXACT)
    assert m.uneven is None
    assert len(m.ranks) == 2  # the last rank owns 5 of the head's 61 rows, not 8


def test_mixed_precision_shards_stay_float32_frozen_ones_do_not():
    bf16 = spec(("layers.0.w", (8, 8), "bfloat16"))
    stores = lambda cfg, s=bf16: {p.store for p in place(plan(s, LayoutOptions(world_size=2)), cfg)}  # noqa: E731
    assert stores(EXACT) == {"float32"}
    assert stores(MemoryConfig(master_weights=False, round_bytes=1)) == {"bfloat16"}
    frozen = spec(("layers.0.w", (8, 8), "bfloat16"), frozen=True)
    assert stores(EXACT, frozen) == {"bfloat16"}
    fsdp = estimate_memory(plan(bf16, LayoutOptions(world_size=2)), EXACT).references[-1]
    # 32 fp32 elements per rank: shard, gradient shard, two states; no master copy
    assert (fsdp.params, fsdp.grads, fsdp.optimizer, fsdp.master) == (128, 128, 256, 0)
    assert fsdp.gather == 64 * 2  # the unit gathered in bfloat16


def test_cuda_rounding_per_parameter_but_per_unit_for_gradients():
    three = spec(*((f"layers.0.w{i}", (4, 4), "float32") for i in range(3)))
    fsdp = estimate_memory(plan(three, LayoutOptions(world_size=2)), MemoryConfig()).references[-1]
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (3 * 512, 512, 6 * 512)


def test_bad_placement_is_an_error():
    with pytest.raises(YafsdpError, match=r"--fsdp-placement 'dim2' is not one of dim0\|auto"):
        fsdp2_memory(plan(EXPERTS, LayoutOptions(world_size=2)), EXACT, "dim2")


def test_glob_names_folds_numbered_components():
    names = ["model.layers.0.mlp.w", "model.layers.11.mlp.w", "0.weight", "h.1.attn.c_0.w"]
    assert glob_names(names) == ("model.layers.*.mlp.w", "*.weight", "h.*.attn.c_0.w")


# ---------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_models import tiny_config

    path = tmp_path_factory.mktemp("mixtral")
    tiny_config("mixtral").save_pretrained(path)  # config only: built on meta
    return str(path)


def inspect(*args):
    return runner.invoke(app, ["inspect", *args])


@pytest.mark.hf
def test_report_warns_names_the_experts_and_gives_the_remedy(mixtral):
    table = inspect(mixtral, "-n", "8")
    assert table.exit_code == 0, table.output
    assert "warning: FSDP2 splits parameters unevenly at world size 8" in table.stdout
    result = inspect(mixtral, "-n", "8", "--format", "markdown")  # no wrapped cells
    out = result.stdout.replace("\\", "")
    assert "### warning: FSDP2 splits parameters unevenly at world size 8" in out
    assert "model.layers.*.mlp.experts.gate_up_proj" in out
    assert "more than an even split" in out and "with Shard(1)" in out
    assert "Shard(1) if tuple(p.shape) in {(4, 32), (4, 128, 32), (4, 32, 64)} else None" in out
    assert "FSDP2 per rank (Shard(0)): ranks differ" in out and "0-3" in out and "4-7" in out


@pytest.mark.hf
def test_json_keeps_stdout_clean_and_warns_on_stderr(mixtral):
    import jsonschema

    result = inspect(mixtral, "-n", "8", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert result.stderr.startswith("warning: FSDP2's fullest rank holds")
    assert result.stderr.count("\n") == 1
    fsdp = next(s for s in doc["memory"]["schemes"] if s["scheme"] == "fsdp")
    assert [g["ranks"] for g in fsdp["ranks"]] == [[0, 3], [4, 7]]
    assert fsdp["persistent"] == max(g["persistent"] for g in fsdp["ranks"])
    auto = json.loads(inspect(mixtral, "-n", "8", "--json", "--fsdp-placement", "auto").stdout)
    fsdp_auto = next(s for s in auto["memory"]["schemes"] if s["scheme"] == "fsdp")
    assert len(fsdp_auto["ranks"]) == 1
    assert fsdp_auto["persistent"] == doc["memory"]["fsdp_uneven"]["dim1_bytes"]
    assert auto["inputs"]["fsdp_placement"] == "auto"


@pytest.mark.hf
def test_no_warning_where_experts_split_evenly(mixtral):
    result = inspect(mixtral, "-n", "4", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout)["memory"]["fsdp_uneven"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp-placement", "dim2"], "--fsdp-placement 'dim2' is not one of dim0|auto"),
        (["--round-bytes", "0"], "--round-bytes must be at least 1, got 0"),
    ],
)
def test_usage_errors(args, message):
    from tests.inspection.test_inspect import LLAMA, failure

    assert message in failure(LLAMA, *args)
