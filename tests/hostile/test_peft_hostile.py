"""Bad PEFT adapter folders and ``--lora`` texts through every command that takes
them: exit 2, one line of ours naming the file and field (or the option), nothing
written, no pickle run; and the adapter of a plan is built on the meta device
whatever its rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

from .common import Case, snapshot
from .peft_cases import ADAPTERS, LORA, MARKER, adapter_config, base, write_adapter

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.hf
runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def argv(command: str, src: Path, folder: Path) -> list[str]:
    return {
        "inspect": ["inspect", src],
        "plan": ["plan", src, "--gpu-memory", "1GiB", "--world-size", "1", "--jobs", "1"],
        "profile": ["profile", src, "--fake"],
        "convert": ["convert", src, "-o", folder / "o.safetensors"],
        "verify": ["verify", src],
        "check": ["check", src, "--baseline", folder / "baseline.json", "--update"],
    }[command]


def refused(folder: Path, args: list) -> str:
    """The one error line of ``args``, checked: exit 2, ours, nothing written."""
    before = snapshot(folder)
    result = runner.invoke(app, [str(a) for a in args])
    after = snapshot(folder)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.output, lines[0]
    assert after == before, sorted(set(after) ^ set(before))
    assert not (folder / MARKER).exists(), "the pickle ran code"
    return lines[0]


def adapter_params():
    for case in ADAPTERS:
        for command in case.commands:
            yield pytest.param(case, command, id=f"{case.id}-{command}")


@pytest.mark.parametrize(("case", "command"), list(adapter_params()))
def test_bad_adapter_folder_is_refused_cleanly(tmp_path, case: Case, command: str):
    folder = tmp_path / "case"
    folder.mkdir()
    src = case.build(folder)
    line = refused(folder, argv(command, src, folder))
    assert re.search(case.message, line), f"{case.message!r} not in {line!r}"
    assert str(src) in line, f"{src} not named in {line!r}"


@pytest.mark.parametrize(
    ("text", "message", "command"),
    [
        pytest.param(text, message, command, id=f"lora-{name}-{command}")
        for name, text, message in LORA
        for command in ("inspect", "plan", "profile", "check")
    ],
)
def test_bad_lora_is_refused_cleanly(tmp_path, text: str, message: str, command: str):
    folder = tmp_path / "case"
    folder.mkdir()
    src = base(folder)
    line = refused(folder, [*argv(command, src, folder), "--lora", text])
    assert line.startswith(f"error: --lora {text!r}: "), line
    assert re.search(message, line), f"{message!r} not in {line!r}"


def test_the_generated_adapter_is_good(tmp_path):
    """The cases change one thing of an adapter that loads: with safetensors or .bin
    weights (a .bin of tensors only reads through the weights-only path), the real
    module holds the file's weights."""
    from yafsdp_cli.sources import load_source

    base(tmp_path)
    for weights in ("st", "bin"):
        src = write_adapter(tmp_path, f"adapter-{weights}", weights=weights)
        result = runner.invoke(app, ["inspect", str(src)])
        assert result.exit_code == 0, result.output
        module = load_source(src).build_module()
        lora = {n: p for n, p in module.named_parameters() if "lora_" in n}
        assert len(lora) == 8 and all(bool((p == 0.5).all()) for p in lora.values())


def test_convert_of_an_adapter_folder_says_to_convert_its_base(tmp_path):
    base(tmp_path)
    src = write_adapter(tmp_path)
    line = refused(tmp_path, ["convert", src, "-o", tmp_path / "o.safetensors"])
    assert f"error: {src}: 'model.layers.0.self_attn.q_proj.base_layer.weight' is a LoRA" in line
    assert line.endswith(f"convert its base ({src / '..' / 'base'})"), line


def test_an_adapter_without_target_modules_adapts_peft_s_defaults(tmp_path):
    """``target_modules: null``: peft picks the architecture's own (q_proj and v_proj
    for a Llama), which the report names."""
    base(tmp_path)
    src = write_adapter(tmp_path, config=adapter_config(target_modules=None))
    result = runner.invoke(app, ["inspect", str(src)])
    assert result.exit_code == 0, result.output
    assert "r=4, alpha=8 on q_proj,v_proj" in " ".join(result.stdout.split())


def test_the_config_is_read_once_and_capped_before_parsing(tmp_path, monkeypatch):
    """peft is given the document yafsdp read (capped), never the path to read again."""
    import peft

    from yafsdp_cli import fileio

    def read_again(*args, **kwargs):
        raise AssertionError("peft read adapter_config.json again")

    monkeypatch.setattr(peft.LoraConfig, "from_json_file", classmethod(read_again))
    base(tmp_path)
    src = write_adapter(tmp_path)
    assert runner.invoke(app, ["inspect", str(src)]).exit_code == 0
    (src / "adapter_config.json").write_text(json.dumps(adapter_config(pad=" " * 8192)))
    monkeypatch.setitem(fileio.read_json.__kwdefaults__, "cap", 4096)
    line = refused(tmp_path, ["inspect", src])
    assert f"{src}/adapter_config.json: its JSON holds more than 4096 bytes" in line, line


# the adapter of a plan costs no memory, whatever its rank

WIDE = 8192  # one 8192 x 8192 layer: LoRA at full rank is 2 x 256 MiB of float32

_META_BUILD = """
import resource, sys
import peft, torch
from yafsdp_cli.sources import load_source
from yafsdp_cli.sources.adapted import adapt
from yafsdp_cli.options import StepOptions

loaded = load_source(None, model=sys.argv[1])
# the address space this process may grow by from here: 128 MiB, half of one LoRA
# matrix; peft making the matrices on the CPU first would fail to allocate
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 128 * 2**20, resource.RLIM_INFINITY))
model = adapt(loaded, StepOptions(lora="r=8192,targets=proj"))
lora = {n: p for n, p in model.module.named_parameters() if "lora_" in n}
assert sorted(lora) == ["proj.lora_A.default.weight", "proj.lora_B.default.weight"], lora
assert all(p.is_meta and p.numel() == 8192 * 8192 for p in lora.values())
print("meta", sum(p.numel() for p in model.module.parameters()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_lora_of_a_plan_is_built_on_the_meta_device(tmp_path):
    factory = tmp_path / "wide.py"
    factory.write_text(
        textwrap.dedent(f"""
        import torch

        class Wide(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear({WIDE}, {WIDE}, bias=False)

            def forward(self, x):
                return self.proj(x)
        """)
    )
    done = subprocess.run(
        [sys.executable, "-c", _META_BUILD, f"{factory}:Wide"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["meta", str(3 * WIDE * WIDE)]
