"""Bad PEFT adapter folders and ``--lora`` texts, generated.

An adapter folder here is what ``PeftModel.save_pretrained`` writes over a tiny
config-only Llama (hidden 32, two layers, ``v_proj`` 32 -> 16): ``adapter_config.json``
and ``adapter_model.safetensors`` holding ``lora_A``/``lora_B`` of ``q_proj`` and
``v_proj``, written with safetensors' own writer so no peft is needed to build one.
Each case changes one thing. ``LORA`` cases are ``--lora`` texts given with that
Llama as the source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from .common import Case
from .torch_cases import MARKER, _Evil

# commands that read an adapter folder as SOURCE, and those that take --lora
ADAPTER_COMMANDS = ("inspect", "plan", "profile", "convert", "verify", "check")
LORA_COMMANDS = ("inspect", "plan", "profile", "check")
HIDDEN, KV_OUT, LAYERS = 32, 16, 2  # tests/hf_models.py's tiny Llama
# what peft names each LoRA matrix in the file, and its shape at rank r
TARGETS = {"q_proj": HIDDEN, "v_proj": KV_OUT}


def base(folder: Path) -> Path:
    """A config-only tiny Llama: meta weights for plans, random ones for real steps."""
    from hf_models import tiny_config

    cfg = tiny_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.torch_dtype = "float32"
    cfg.save_pretrained(folder / "base")
    return folder / "base"


def adapter_config(**changes) -> dict:
    doc = {
        "peft_type": "LORA",
        "base_model_name_or_path": "../base",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "task_type": None,
    }
    return {**doc, **changes}


def adapter_tensors(r: int = 4) -> dict:
    import torch

    out = {}
    for i in range(LAYERS):
        for name, width in TARGETS.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            out[f"{key}.lora_A.weight"] = torch.full((r, HIDDEN), 0.5)
            out[f"{key}.lora_B.weight"] = torch.full((width, r), 0.5)
    return out


def write_adapter(
    folder: Path, name: str = "adapter", config: dict | None = None, weights: str = "st", r=4
) -> Path:
    """An adapter folder ``folder/name``; ``weights``: "st" (safetensors), "bin"
    (``torch.save``) or "" (none)."""
    import torch
    from safetensors.torch import save_file

    path = folder / name
    path.mkdir()
    text = json.dumps(config or adapter_config(), allow_nan=True)
    (path / "adapter_config.json").write_text(text)
    if weights == "st":
        save_file(adapter_tensors(r), str(path / "adapter_model.safetensors"))
    elif weights == "bin":
        torch.save(adapter_tensors(r), path / "adapter_model.bin")
    return path


def _config(**changes) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        base(folder)
        return write_adapter(folder, config=adapter_config(**changes))

    return build


def _raw_config(text: str) -> Callable[[Path], Path]:
    """A config whose JSON text is given as is (json.dumps cannot write 10**400)."""

    def build(folder: Path) -> Path:
        base(folder)
        path = write_adapter(folder)
        (path / "adapter_config.json").write_text(text)
        return path

    return build


def _wrong_shape(weights: str) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        base(folder)
        return write_adapter(folder, weights=weights, r=8)  # the config says r=4

    return build


def _self_base(folder: Path) -> Path:
    base(folder)
    return write_adapter(folder, config=adapter_config(base_model_name_or_path="."))


def _each_others_base(folder: Path) -> Path:
    base(folder)
    write_adapter(folder, "b", config=adapter_config(base_model_name_or_path="../adapter"))
    return write_adapter(folder, config=adapter_config(base_model_name_or_path="../b"))


def _pickled_code(folder: Path) -> Path:
    import torch

    base(folder)
    path = write_adapter(folder, weights="")
    torch.save({"w": _Evil(folder / MARKER)}, path / "adapter_model.bin")
    return path


def _huge_rank(folder: Path) -> Path:
    """r of a billion: peft would make 128 GB of float32 LoRA matrices on the CPU."""
    base(folder)
    return write_adapter(folder, config=adapter_config(r=10**9))


CFG = r"adapter_config\.json: "
ALPHA_400 = json.dumps(adapter_config()).replace('"lora_alpha": 8', '"lora_alpha": 1' + "0" * 400)
SHAPE = r"has shape \[8, 32\], but the base and adapter_config\.json make it \[4, 32\]"
ADAPTERS = [
    Case("peft-r-string", _config(r="four"), CFG + r"r 'four' is not a whole number"),
    Case("peft-r-fraction", _config(r=4.5), CFG + r"r 4\.5 is not a whole number"),
    Case("peft-r-nan", _config(r=math.nan), CFG + r"r nan is not a whole number"),
    Case("peft-r-bool", _config(r=True), CFG + r"r True is not a whole number"),
    Case("peft-r-zero", _config(r=0), CFG + r"r 0 must be at least 1"),
    Case("peft-r-negative", _config(r=-4), CFG + r"r -4 must be at least 1"),
    Case("peft-r-past-int32", _config(r=2**40), CFG + r"r 1099511627776 is above 2,147,483,647"),
    Case("peft-r-billion", _huge_rank, CFG + r"r=1000000000 is above min\(in_features"),
    Case("peft-alpha-nan", _config(lora_alpha=math.nan), CFG + r"lora_alpha nan must be a finite"),
    Case("peft-alpha-inf", _config(lora_alpha=math.inf), CFG + r"lora_alpha inf must be a finite"),
    Case("peft-alpha-negative", _config(lora_alpha=-8), CFG + r"lora_alpha -8 must be a finite"),
    Case("peft-alpha-past-float", _raw_config(ALPHA_400), CFG + r"lora_alpha 10{20}.* must be"),
    Case("peft-alpha-string", _config(lora_alpha="8"), CFG + r"lora_alpha '8' is not a number"),
    Case("peft-dropout-one", _config(lora_dropout=1.0), CFG + r"lora_dropout 1\.0 must be in \["),
    Case("peft-dropout-nan", _config(lora_dropout=math.nan), CFG + r"lora_dropout nan must be in"),
    Case("peft-dropout-negative", _config(lora_dropout=-0.1), CFG + r"lora_dropout -0\.1 must be"),
    Case("peft-targets-number", _config(target_modules=5), CFG + r"target_modules 5 is neither"),
    Case(
        "peft-targets-mixed",
        _config(target_modules=["q_proj", 1]),
        CFG + r"target_modules \['q_proj', 1\] is neither a list of module names nor a regular",
    ),
    Case(
        "peft-targets-bad-regex",
        _config(target_modules="q_proj("),
        CFG + r"target_modules 'q_proj\(' is not a regular expression",
    ),
    Case(
        "peft-rank-pattern-nan",
        _config(rank_pattern={"q_proj": math.nan}),
        CFG + r"rank_pattern\['q_proj'\] nan is not a whole number",
    ),
    Case(
        "peft-rank-pattern-list",
        _config(rank_pattern=[4]),
        CFG + r"rank_pattern \[4\] is not an object",
    ),
    Case(
        "peft-alpha-pattern-inf",
        _config(alpha_pattern={"v_proj": math.inf}),
        CFG + r"alpha_pattern\['v_proj'\] inf must be a finite",
    ),
    Case(
        "peft-rank-pattern-null",
        _config(rank_pattern=None),
        CFG + r"rank_pattern None is not an object",
    ),
    Case(
        "peft-modules-to-save-number",
        _config(modules_to_save=[1]),
        CFG + r"modules_to_save \[1\] is not a list of module names",
    ),
    Case("peft-bias-unknown", _config(bias="x"), CFG + r"bias 'x' is none of 'none', 'all'"),
    # fields with no rule of ours: what peft cannot take, named by the file
    Case(
        "peft-init-number",
        _config(init_lora_weights=5),
        CFG + r"peft (refuses it|cannot build this adapter) \(AttributeError: .int. object",
    ),
    Case(
        "peft-megatron",
        _config(megatron_config={"a": 1}),
        CFG + r"peft (refuses it|cannot build this adapter) \(.*No module named 'megatron'",
    ),
    Case(
        "peft-base-name-too-long",
        _config(base_model_name_or_path="x" * 5000),
        r"the adapter's base 'x{76}\.\.\. is not a local folder \(yafsdp does not download\)",
    ),
    Case(
        "peft-base-is-itself",
        _self_base,
        CFG + r"base_model_name_or_path '\.' is this adapter folder itself, not a base model",
    ),
    Case(
        "peft-bases-each-other",
        _each_others_base,
        CFG + r"base_model_name_or_path '\.\./b' is the adapter folder .*b, not a base model",
    ),
    Case(
        "peft-weights-wrong-shape",
        _wrong_shape("st"),
        r"adapter_model\.safetensors: 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj"
        r"\.lora_A\.weight' " + SHAPE,
    ),
    Case("peft-bin-wrong-shape", _wrong_shape("bin"), r"adapter_model\.bin: '.*' " + SHAPE),
    Case(
        "peft-bin-pickled-code",
        _pickled_code,
        r"adapter_model\.bin holds a pickled (posix|os)\.system; loading it runs code",
    ),
]
for _c in ADAPTERS:
    _c.needs = "hf"
    _c.commands = ADAPTER_COMMANDS


# (id, --lora text, what the one error line says after "--lora 'TEXT': ")
LORA = [
    ("r-billion", "r=1000000000,targets=q_proj,v_proj", r"r=1000000000 is above min\(in_features"),
    ("r-past-int32", "r=99999999999,targets=q_proj", r"r=99999999999 is above 2,147,483,647"),
    ("r-fraction", "r=4.5,targets=q_proj", r"r='4\.5' is not a whole number"),
    ("alpha-nan", "r=4,alpha=nan,targets=q_proj", r"alpha=nan must be a finite number above 0"),
    ("alpha-inf", "r=4,alpha=inf,targets=q_proj", r"alpha=inf must be a finite number above 0"),
    ("alpha-past-float", "r=4,alpha=1e400,targets=q_proj", r"alpha=1e400 must be a finite"),
    ("dropout-nan", "r=4,dropout=nan,targets=q_proj", r"dropout=nan must be in \[0, 1\)"),
    ("targets-absent", "r=4,targets=nope", r"Target modules \{'nope'\} not found"),
]
