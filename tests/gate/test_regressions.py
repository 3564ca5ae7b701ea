"""Which modules account for grown activations (``gate.regressions.explain``)."""

from __future__ import annotations

from yafsdp_cli.gate.baseline import ModuleSaved
from yafsdp_cli.gate.regressions import explain, module_changes
from yafsdp_cli.gate.step_figures import pattern, saved_by_pattern


def rows(**saved: int) -> tuple[ModuleSaved, ...]:
    return tuple(ModuleSaved(name.replace("__", "."), 1, b) for name, b in saved.items())


def test_pattern_replaces_whole_numeric_parts_only():
    assert pattern("model.layers.12.mlp") == "model.layers.*.mlp"
    assert pattern("h.0") == "h.*" and pattern("0.w") == "*.w"
    assert pattern("block2.fc1") == "block2.fc1"


def test_saved_by_pattern_sums_repeated_blocks():
    out = saved_by_pattern([("m.layers.0.attn", 5), ("m.layers.1.attn", 7), ("m", 20)])
    assert out == (ModuleSaved("m", 1, 20), ModuleSaved("m.layers.*.attn", 2, 12))


def test_growth_in_one_module_names_it_through_a_module_list():
    old = rows(model=10, model__layers__x__attn=4, model__layers__x__mlp=4, model__layers__x=9)
    new = rows(model=30, model__layers__x__attn=24, model__layers__x__mlp=4, model__layers__x=29)
    assert explain(old, new) == ("model.layers.x.attn",)


def test_spread_growth_names_the_parent_and_shares():
    old = rows(model=0, model__a=0, model__a__p=0, model__a__q=0)
    new = rows(model=100, model__a=100, model__a__p=50, model__a__q=30)
    assert explain(old, new) == ("model.a (p 50%, q 30%)",)


def test_no_growth_names_nothing():
    same = rows(model=10, model__a=5)
    assert explain(same, same) == ()
    assert explain(rows(model=10), rows(model=4)) == ()


def test_module_changes_keep_vanished_and_new_modules():
    changes = module_changes(rows(model=10, old=3), rows(model=12, new=5), top=3)
    assert [(c.pattern, c.baseline, c.current) for c in changes] == [
        ("model", 10, 12),
        ("new", 0, 5),
        ("old", 3, 0),
    ]


def test_a_figure_regresses_past_both_its_percent_and_its_byte_floor():
    from yafsdp_cli.gate.regressions import MIN_BYTES, Threshold, metric

    tiny = metric("buffers at peak", "bytes", 256, 288, Threshold(0.1), "step")  # +32 B
    assert tiny.change_percent == 12.5 and not tiny.regressed
    assert metric("buffers at peak", "bytes", 256, 288, Threshold(0.1, 0), "step").regressed
    big = metric("step peak", "bytes", 100 * MIN_BYTES, 102 * MIN_BYTES, Threshold(1), "step")
    assert big.regressed  # 2 MiB, 2%
    assert not metric(
        "step peak", "bytes", 100 * MIN_BYTES, 102 * MIN_BYTES, Threshold(5), "s"
    ).regressed
    # From nothing: any growth is past the percent, so the floor decides.
    assert not metric("gradients", "bytes", 0, 4096, Threshold(0.1), "step").regressed
    assert metric("gradients", "bytes", 0, 2 * MIN_BYTES, Threshold(0.1), "step").regressed


def test_regressions_are_listed_largest_growth_first():
    from yafsdp_cli.gate.regressions import CheckReport, MetricCheck

    def grown(name, unit, old, new):
        return MetricCheck(name, unit, old, new, 100.0 * (new - old) / old, True)

    metrics = (
        grown("parameters", "elements", 10, 20),
        grown("a", "bytes", 10, 20),
        grown("b", "bytes", 10, 50),
        MetricCheck("c", "bytes", 10, 10, 0.0, False),
        grown("d", "bytes", 100, 120),
    )
    report = CheckReport("b.json", "m", 1.0, 0.1, metrics, {})
    assert [m.name for m in report.regressions] == ["b", "d", "a", "parameters"]
