"""The table layout's pieces: words never cut, names folded apart, widths shared."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from yafsdp_cli.report.fit_table import (
    Cell,
    Column,
    fit_table,
    fold_name,
    share,
    shortest,
    shortest_names,
    wrap,
)

PARTS = ["model", "layers", "0", "1", "12", "*", "self_attn", "q_proj", "mlp", "input_layernorm",
         "post_attention_layernorm", "weight", "bias"]  # fmt: skip
PART = st.sampled_from(PARTS)
NAMES = st.lists(st.lists(PART, min_size=1, max_size=6).map(".".join), min_size=1, max_size=12)


def test_a_figure_keeps_its_unit_and_a_shape_stays_whole():
    assert shortest("needed 843.81 MiB") == len("843.81 MiB")
    assert wrap("needed 843.81 MiB of it", 10) == ["needed", "843.81 MiB", "of it"]
    assert shortest("(14336, 4096)") == len("(14336, 4096)")
    assert wrap("lm_head.weight[0:4,096]", 16) == ["lm_head.weight", "[0:4,096]"]
    assert wrap("keeping 2.39 GiB free", 8, dots=True) == ["keeping", "2.39 GiB", "free"]


def test_folded_names_keep_their_distinguishing_parts():
    names = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "lm_head.weight",
    ]
    forms = shortest_names(names)
    assert forms[names[0]] == "…layers.0.input_layernorm.weight"
    assert forms[names[1]] == "…post_attention_layernorm.weight"
    assert forms[names[3]] == "lm_head.weight"
    assert fold_name(names[1], 32) == "…post_attention_layernorm.weight"
    assert fold_name("model.layers.*.post_attention_layernorm", 30) == "…post_attention_layernorm"


@settings(max_examples=200, deadline=None)
@given(NAMES, st.integers(0, 40))
def test_a_name_column_at_its_shortest_keeps_every_two_names_apart(names, extra):
    column = Column("name", tuple(Cell(n) for n in names), name=True)
    width = column.low + extra
    folded = {n: fold_name(n, width) for n in set(names)}
    assert len(set(folded.values())) == len(folded)
    assert all(len(f) <= width for f in folded.values())


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=8),
       st.integers(1, 200))  # fmt: skip
def test_shared_widths_fit_and_never_go_below_the_shortest_form(spans, room):
    lows = [lo for lo, _ in spans]
    highs = [lo + more for lo, more in spans]
    widths = share(lows, highs, room)
    if sum(lows) > room:
        assert widths is None
        return
    assert widths is not None and sum(widths) <= room
    assert all(lo <= w <= h for lo, w, h in zip(lows, widths, highs))


def printed(table, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue()


@settings(max_examples=60, deadline=None)
@given(NAMES, st.integers(40, 140))
def test_a_table_is_never_wider_than_the_console(names, width):
    rows = [(n, f"{i * 1234567:,}", "843.81 MiB", "non-reentrant") for i, n in enumerate(names)]
    table = fit_table("t", ("name", "offset", "needed", "checkpointing"), rows, names=(0,))
    for line in printed(table, width).splitlines():
        assert len(line) <= width, line
