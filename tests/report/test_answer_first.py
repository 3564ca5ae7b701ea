"""The answer first: inspect and profile open with at most five lines that answer
the question, before any table, at 80 and 120 columns, never splitting a figure; and
the table, markdown, JSON and HTML renderings show the same figures."""

from __future__ import annotations

import io
import json
import re
from importlib import resources

import jsonschema
import pytest
from helpers import options
from rich.console import Console

from tests.conftest import SAMPLES
from yafsdp_cli.inspection.build import inspect_model
from yafsdp_cli.inspection.inspect_options import InspectOptions
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.report import inspect_view, profile_view
from yafsdp_cli.report.formatting import human_bytes
from yafsdp_cli.report.html_pages import inspect_page, profile_page
from yafsdp_cli.sources import load_source

LLAMA = SAMPLES / "llama.safetensors"
FIGURE = re.compile(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)")


@pytest.fixture(scope="module")
def inspected():
    return inspect_model(load_source(LLAMA), options(InspectOptions, world_size=8))


@pytest.fixture(scope="module")
def profiled():
    loaded = load_source(None, model="sample_models.models:mlp")
    return profile_model(loaded, options(ProfileOptions, seq_len=8, batch=2))


def rendered(renderables, width: int) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, highlight=False)
    for r in renderables:
        console.print(r)
    return out.getvalue().splitlines()


def opening(lines: list[str]) -> list[str]:
    """The lines before the first blank one: the answer."""
    return lines[: lines.index("")]


def check_opening(answer: list[str], lines: list[str], width: int) -> None:
    head = opening(lines)
    assert len(answer) <= 5
    assert 1 <= len(head) <= 2 * len(answer)
    assert all(len(line) <= width for line in head)
    # every figure of the answer is on one line: wrapped between figures, never inside
    for figure in FIGURE.findall(" ".join(answer)):
        assert any(figure in line for line in head), (figure, head)
    joined = " ".join(line.strip() for line in head)
    assert " ".join(" ".join(answer).split()) == " ".join(joined.split())
    assert not any("┏" in line or "┌" in line for line in head)  # no table yet


@pytest.mark.parametrize("width", [80, 120])
def test_inspect_answers_first(inspected, width):
    answer = inspect_view.answer(inspected)
    lines = rendered(inspect_view.to_rich(inspected), width)
    check_opening(answer, lines, width)
    by = {s.scheme.inspect_key: s for s in inspected.memory.schemes}
    best = min(("zero2", "zero3", "fsdp"), key=lambda k: by[k].total)
    flat = by["yafsdp"].total
    assert answer[0] == (
        f"at world size 8: yafsdp flat {human_bytes(flat)} per rank, "
        f"{human_bytes(flat - by[best].total)} more than "
        f"{inspect_view.header(by[best].scheme)} {human_bytes(by[best].total)}, "
        "the best other scheme"
    )
    assert answer[1].startswith("why: flat keeps 2 all-gather and 2 gradient buffers")
    saved = by["yafsdp"].savings_percent
    assert f"DDP {human_bytes(by['ddp'].total)} (flat saves {saved:.1f}%)" in answer[2]
    for scheme in ("zero2", "zero3", "fsdp"):
        assert human_bytes(by[scheme].total) in answer[2]
    assert answer[3].startswith(inspected.assumptions[0])


@pytest.mark.parametrize("width", [80, 120])
def test_profile_answers_first(profiled, width):
    answer = profile_view.answer(profiled)
    lines = rendered(profile_view.to_rich(profiled), width)
    check_opening(answer, lines, width)
    assert answer[0] == profile_view.verdict(profiled)
    o, c = profiled.original.peak.total, profiled.converted_step.peak.total
    assert f"original {human_bytes(o)}" in answer[1] and f"converted {human_bytes(c)}" in answer[1]
    assert answer[-1] == profiled.training_dtype


def test_inspect_four_renderings_agree(inspected):
    table = "\n".join(rendered(inspect_view.to_rich(inspected), 200))
    markdown = inspect_view.to_markdown(inspected)
    doc = json.loads(inspect_view.to_json(inspected))
    page = inspect_page(inspected)
    assert doc["memory"]["flat_bytes"] == inspected.memory.flat_bytes
    for scheme in doc["memory"]["schemes"]:
        figure = human_bytes(scheme["total"])
        for name, text in (("table", table), ("markdown", markdown), ("html", page)):
            assert figure in text, (name, scheme["scheme"], figure)
    first = inspect_view.answer(inspected)[0]  # markdown escapes ZeRO-3*'s star
    assert markdown.splitlines()[0].rstrip() == first.replace("*", "\\*")


def test_profile_four_renderings_agree(profiled):
    table = "\n".join(rendered(profile_view.to_rich(profiled), 200))
    markdown = profile_view.to_markdown(profiled)
    doc = json.loads(profile_view.to_json(profiled))
    page = profile_page(profiled)
    assert doc["saving_bytes"] == profiled.saving_bytes
    assert doc["training_dtype"] == profiled.training_dtype
    for step in ("original", "converted"):
        peak = doc[step]["peak_bytes"]
        assert peak == sum(doc[step]["peak"][k] for k in doc[step]["peak"])  # the peak's parts
        for name, text in (("table", table), ("markdown", markdown), ("html", page)):
            assert human_bytes(peak) in text, (name, step)
    assert markdown.splitlines()[0].rstrip() == profile_view.verdict(profiled)


@pytest.mark.parametrize("width", [80, 120])
def test_verify_gives_its_verdict_first(width):
    from yafsdp_cli.report import verify_view
    from yafsdp_cli.verify import VerifyOptions, verify_model

    report = verify_model(
        load_source(None, model="sample_models.models:mlp"), options(VerifyOptions, steps=1)
    )
    lines = rendered(verify_view.to_rich(report), width)
    verdict = verify_view.verdict(report)
    assert verdict.startswith("OK: ")
    check_opening([verdict], lines, width)
    assert verify_view.to_markdown(report).startswith(f"**{verdict}**")


def tables(lines: list[str], header: str) -> list[list[list[str]]]:
    """The cells of each row of every table whose header row starts with ``header``."""
    found = []
    for start in (i for i, line in enumerate(lines) if line.startswith(f"┃ {header} ")):
        rows = []
        for line in lines[start + 2 :]:
            if not line.startswith("│"):
                break
            rows.append([c.strip() for c in line.strip("│").split("│")])
        found.append(rows)
    return found


@pytest.mark.parametrize("width", [80, 120])
def test_names_stay_distinct_and_numbers_whole_at_any_width(inspected, width):
    lines = rendered(inspect_view.to_rich(inspected), width)
    assert all(len(line) <= width for line in lines)
    block = next(b for b in inspected.buffers if any("q_proj" in e.name for e in b.entries))
    full = [e.name for e in block.entries]
    shown = next(
        [row[0] for row in rows] for rows in tables(lines, "entry") if "proj" in rows[0][0]
    )
    assert len(set(shown)) == len(full) == 7  # seven projections, seven names
    for name, cell in zip(full, shown, strict=True):
        tail = ".".join(name.split(".")[-2:])  # q_proj.weight
        assert cell == name or (cell.endswith(tail) and "…" in cell), (name, cell)
    shards = [row for rows in tables(lines, "rank") for row in rows]
    assert shards
    for row in shards:  # the shard maps: slices and numbers whole; "holds" may wrap
        if row[0]:
            assert re.fullmatch(r"\d+|\.\.\.", row[0]), row
            assert re.fullmatch(r"\[[\d,]+:[\d,]+\]|", row[1]), row
        else:
            assert row[1] == "" and row[3] == "", row  # a wrapped "holds" cell


@pytest.fixture(scope="module")
def planned():
    from yafsdp_cli.planning import PlanOptions, plan_model

    loaded = load_source(None, model="sample_models.models:gpt")
    opts = options(
        PlanOptions,
        gpu_memory=80 * 2**30,
        world_sizes=(1, 2),
        micro_batches=(1, 2),
        seq_len=16,
        jobs=1,
    )
    return plan_model(loaded, opts)


@pytest.mark.parametrize("width", [80, 120])
def test_plan_answers_first(planned, width):
    from yafsdp_cli.report import plan_view

    answer = plan_view.answer(planned)
    lines = rendered(plan_view.to_rich(planned), width)
    check_opening(answer, lines, width)
    fewest = min(s.world_size for s in planned.smallest if s.world_size is not None)
    assert answer[0].startswith(f"fewest GPUs: {fewest}, at micro-batch ")
    b = planned.best
    assert answer[1].startswith(
        f"recommended: world size {b.world_size}, micro-batch {b.micro_batch}, "
        f"checkpointing {b.checkpointing}, needed {human_bytes(b.needed_bytes)}"
    )
    assert answer[-1].startswith("assumed: 16 tokens per sequence, bfloat16 parameters")
    # no grid cell is cut short at either width: every cell keeps its verdict
    assert not any("…" in line for line in lines)
    assert "more lines on the figures and the method: --explain" in lines[-1]
    assert not any("fake runs" in line for line in lines)
    explained = rendered(plan_view.to_rich(planned, explain=True), width)
    assert any("fake runs" in line for line in explained)


def test_plan_four_renderings_agree(planned):
    from yafsdp_cli.report import plan_view

    table = "\n".join(rendered(plan_view.to_rich(planned), 200))
    markdown = plan_view.to_markdown(planned)
    doc = json.loads(plan_view.to_json(planned))
    page = plan_view.plan_page(planned)
    assert doc["best"]["needed_bytes"] == planned.best.needed_bytes
    for r in doc["rows"]:
        cell = f"{human_bytes(r['needed_bytes'])} {'fits' if r['fits'] else 'OOM'}"
        for name, text in (("table", table), ("markdown", markdown), ("html", page)):
            assert cell in text, (name, cell)
    first = plan_view.answer(planned)[0]
    assert markdown.splitlines()[0].rstrip() == first
    assert f'<p class="verdict pass">{first}</p>' in page
    assert "Peak per rank" not in page and 'id="expand-all"' not in page
    assert ">1 GPU<" in page and "1 GPUs" not in page


def test_profile_notes_on_the_method_wait_for_explain(profiled):
    lines = "\n".join(rendered(profile_view.to_rich(profiled), 120))
    full = "\n".join(rendered(profile_view.to_rich(profiled, explain=True), 120))
    assert "one warm-up step" not in lines and "one warm-up step" in full
    assert f"{len(profiled.notes)} more on how the step was run: --explain" in lines
    caveat = "estimated, not measured: 14 frozen linear layers stood in"
    assert profile_view.shown_notes([caveat, "how"], explain=False) == [
        caveat,
        "1 more on how the step was run: --explain",
    ]


GPT_PLAN = ["plan", "--model", "sample_models.models:gpt", "--seq-len", "32", "--world-size",
            "1,16", "--micro-batch", "1,2", "--checkpointing", "none", "--jobs", "1"]  # fmt: skip


def plan_cli(args: list[str]) -> tuple[list[str], dict]:
    """The plan's screen at 80 columns, and its ``--json`` document."""
    from typer.testing import CliRunner

    from yafsdp_cli.cli import app
    from yafsdp_cli.cli.command_kit import stdout

    runner = CliRunner()
    # the console reads COLUMNS when it is made: one made by an earlier test in this
    # process would keep that test's width
    stdout._console = None
    try:
        shown = runner.invoke(app, args, env={"COLUMNS": "80"})
    finally:
        stdout._console = None
    assert shown.exit_code == 0, shown.output
    doc = runner.invoke(app, [*args, "--json"])
    assert doc.exit_code == 0, doc.output
    parsed = json.loads(doc.stdout)
    schema = resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text()
    jsonschema.validate(parsed, json.loads(schema))
    return shown.stdout.splitlines(), parsed


def test_plan_answer_gives_the_gpu_hours_of_the_tokens():
    """``--tokens`` with a GPU named: the first screen says what the budget costs on
    the recommended configuration, the figures the document's ``timing`` has."""
    args = [*GPT_PLAN, "--gpu", "h100-sxm", "--tokens", "1T", "--objective", "gpu-hours"]
    lines, doc = plan_cli(args)
    head = opening(lines)
    assert all(len(line) <= 80 for line in head)
    t, ws = doc["timing"], doc["best"]["world_size"]
    gpus = "1 GPU" if ws == 1 else f"{ws} GPUs"
    said = f"1T tokens: {t['gpu_hours']:,.0f} GPU-hours, {t['wall_hours']:,.0f} h on {gpus}"
    assert said in head and said in doc["answer"], head
    assert head.index(said) < next(i for i, x in enumerate(head) if x.startswith("assumed:"))


@pytest.fixture
def llama(tmp_path):
    """A config-only Hugging Face Llama folder (meta weights: plan runs fake steps)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from hf_models import tiny_config

    cfg = tiny_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.mark.hf
def test_plan_answer_names_the_fine_tuning_and_what_is_estimated(llama):
    """A LoRA, QLoRA or ``--freeze`` plan's ``assumed:`` line says so, and that a
    quantized base's bytes are estimated; a full fine-tune's names none of them."""
    args = ["plan", str(llama), "--gpu-memory", "4GiB", "--world-size", "1,2",
            "--micro-batch", "1", "--seq-len", "32", "--checkpointing", "none",
            "--jobs", "1"]  # fmt: skip
    tuned = ["--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--quantize", "nf4"]
    tuned += ["--freeze", "name:*embed*"]
    for extra, said in (
        ([], ()),
        (["--lora", "r=4,targets=q_proj,v_proj"], ("LoRA r=4 on q_proj,v_proj",)),
        (["--freeze", "name:*embed*"], ("frozen: name:*embed*",)),
        (
            tuned,
            (
                "LoRA r=4 on q_proj,v_proj",
                "nf4 base (estimated: bitsandbytes packing)",
                "frozen: name:*embed*",
            ),
        ),
    ):
        lines, doc = plan_cli([*args, *extra])
        head = opening(lines)
        assert all(len(line) <= 80 for line in head)
        assumed = doc["answer"][-1]
        assert assumed.startswith("assumed: 32 tokens per sequence"), assumed
        assert doc["tuning"] == list(said)
        for phrase in said:
            assert phrase in assumed, (phrase, assumed)
        if not said:  # a full fine-tune
            assert not any(w in assumed for w in ("LoRA", "frozen", "estimated")), assumed
        assert ("estimated" in assumed) == ("--quantize" in extra)
        flat = " ".join(" ".join(head).split())
        assert " ".join(assumed.split()) in flat  # the screen wraps it, whole
