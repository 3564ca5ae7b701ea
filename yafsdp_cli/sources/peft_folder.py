"""A PEFT adapter folder as a source: ``adapter_config.json`` and the adapter's weights
(``adapter_model.safetensors`` or ``.bin``), as ``PeftModel.save_pretrained`` writes
them, over the base model its config names.

The base is ``base_model_name_or_path`` read as a local folder (absolute, or
relative to the adapter folder, then to the directory yafsdp runs in): yafsdp does
not download. The result is the base adapted by ``adapted.adapted`` with peft's own
``LoraConfig`` read from the folder; a real build loads the adapter's weights with
``peft.set_peft_model_state_dict``. Only LoRA adapters are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import SourceError
from ..fileio import read_json
from .adapted import AdaptedModel, adapted, import_peft
from .loaded import LoadedModel

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def is_adapter_folder(path: Path) -> bool:
    return (path / CONFIG).is_file()


def load_adapter_folder(path: Path, load_base: Callable[[Path], LoadedModel]) -> LoadedModel:
    """The adapter at ``path`` over its base, which ``load_base`` loads (``load_source``'s
    own path loader: the base is any source kind)."""
    raw = read_json(path / CONFIG)
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        raise SourceError(f"{path}: a PEFT adapter of type {kind!r}; yafsdp reads LoRA adapters")
    base_path = _base_folder(path, raw.get("base_model_name_or_path"))
    weights = next((path / w for w in WEIGHTS if (path / w).is_file()), None)
    if weights is None:
        raise SourceError(f"{path}: an adapter config without weights ({' or '.join(WEIGHTS)})")
    base = load_base(base_path)
    peft = import_peft()
    config = peft.LoraConfig.from_pretrained(str(path))
    config.inference_mode = False  # the adapter trains
    model = adapted(base, config, None, lambda: _weights(weights), ())
    return _described(model, path, base_path, config)


def _base_folder(path: Path, ref) -> Path:
    if not isinstance(ref, str) or not ref:
        raise SourceError(
            f"{path}/{CONFIG} names no base model; set base_model_name_or_path to its folder"
        )
    for candidate in (path / ref, Path(ref)):  # an absolute ref is itself either way
        if candidate.exists():
            return candidate
    raise SourceError(
        f"{path}: the adapter's base {ref!r} is not a local folder (yafsdp does not "
        f"download); download it and set base_model_name_or_path in {CONFIG} to its path"
    )


def _weights(path: Path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _described(model: AdaptedModel, path: Path, base: Path, config) -> AdaptedModel:
    note = f"a PEFT adapter folder over the base {base}"
    notes = (*model.spec.notes, note)
    model.spec = replace(model.spec, source=str(path), source_kind="peft", notes=notes)
    model.path = path
    return model
