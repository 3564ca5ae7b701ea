"""A PEFT adapter folder as a source: ``adapter_config.json`` and the adapter's weights
(``adapter_model.safetensors`` or ``.bin``), as ``PeftModel.save_pretrained`` writes
them, over the base model its config names.

The base is ``base_model_name_or_path`` read as a local folder (absolute, or
relative to the adapter folder, then to the directory yafsdp runs in): yafsdp does
not download. The result is the base adapted by ``adapted.adapted`` with peft's own
``LoraConfig`` made from the folder's config; a real build loads the adapter's
weights with ``peft.set_peft_model_state_dict``. Only LoRA adapters are read.

The config is read once, capped before it is parsed (``fileio.read_json``), and the
numbers the adapter's memory and forward depend on are checked before peft sees them
(``r``, ``lora_alpha``, ``lora_dropout``, their per-module patterns and
``target_modules``), with the rules ``--lora`` has (``engine.finetune``). The base
must be a model, not an adapter folder: a folder naming itself, or two naming each
other, would otherwise be loaded without end. The weights are read as every other
source's are: a safetensors header validated before any byte is trusted, a ``.bin``
through ``torch_file.load_torch_file`` (``weights_only``; a pickle of code is
refused naming what it imports); their shapes are checked against the meta-device
adapter when the source is loaded, so ``inspect`` and ``plan`` refuse an adapter a
real step could not load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine.finetune import alpha_problem, dropout_problem, rank_problem
from ..errors import SourceError, cut, excerpt
from ..fileio import read_json
from .adapted import AdaptedModel, adapted, import_peft
from .loaded import LoadedModel

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json fields that hold module names: a list of names or a regex
_MODULE_KEYS = ("target_modules", "exclude_modules")
_NUMBERS = (("r", rank_problem), ("lora_alpha", alpha_problem), ("lora_dropout", dropout_problem))
_PATTERNS = (("rank_pattern", rank_problem), ("alpha_pattern", alpha_problem))
_BIASES = ("none", "all", "lora_only")  # peft's LoraConfig.bias


@dataclass(frozen=True)
class AdapterWeights:
    """The weights file of an adapter folder: its tensors' shapes (meta tensors, for
    the checks of a meta build) or the tensors themselves (a real build)."""

    path: Path
    config: Path  # the folder's adapter_config.json, for messages
    trust_pickle: bool = False

    def shapes(self) -> dict:
        import torch

        if self.path.suffix == ".safetensors":
            from ..engine import dtypes
            from .safetensors_file import read_header

            return {
                e.name: torch.empty(e.shape, dtype=dtypes.to_torch(e.dtype), device="meta")
                for e in read_header(self.path).entries
            }
        return {k: torch.empty_like(v, device="meta") for k, v in self._torch().items()}

    def load(self) -> dict:
        if self.path.suffix == ".safetensors":
            from .safetensors_file import open_safetensors

            reader = open_safetensors(self.path)
            return {name: reader.load(name) for name in reader.names()}
        return self._torch()

    def _torch(self) -> dict:
        from .torch_file import find_state_dict, load_torch_file

        obj, _ = load_torch_file(self.path, trust_pickle=self.trust_pickle)
        tensors, _ = find_state_dict(obj, self.path)
        return tensors


def is_adapter_folder(path: Path) -> bool:
    return (path / CONFIG).is_file()


def load_adapter_folder(
    path: Path, load_base: Callable[[Path], LoadedModel], *, trust_pickle: bool = False
) -> LoadedModel:
    """The adapter at ``path`` over its base, which ``load_base`` loads (``load_source``'s
    own path loader: the base is any source kind but another adapter folder)."""
    raw = read_json(path / CONFIG)
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        raise SourceError(
            f"{path}: a PEFT adapter of type {excerpt(kind)}; yafsdp reads LoRA adapters"
        )
    _check_config(path / CONFIG, raw)
    base_path = _base_folder(path, raw.get("base_model_name_or_path"))
    weights = next((path / w for w in WEIGHTS if (path / w).is_file()), None)
    if weights is None:
        raise SourceError(f"{path}: an adapter config without weights ({' or '.join(WEIGHTS)})")
    base = load_base(base_path)
    config = _lora_config(path / CONFIG, raw)
    files = AdapterWeights(weights, path / CONFIG, trust_pickle)
    model = adapted(base, config, None, files, ())
    return _described(model, path, base_path, config)


def _check_config(config: Path, raw: dict) -> None:
    """The fields peft would take as given, checked with ``--lora``'s rules."""
    for key, problem in _NUMBERS:
        wrong = problem(raw[key]) if key in raw else None
        if wrong:
            raise SourceError(f"{config}: {key} {excerpt(raw[key])} {wrong}")
    for key, problem in _PATTERNS:
        if key not in raw:
            continue
        pattern = raw[key]
        if not isinstance(pattern, dict):  # null too: peft reads it as a mapping
            raise SourceError(
                f"{config}: {key} {excerpt(pattern)} is not an object of module names and numbers"
            )
        for name, value in pattern.items():
            wrong = problem(value)
            if wrong:
                raise SourceError(f"{config}: {key}[{excerpt(name)}] {excerpt(value)} {wrong}")
    for key in _MODULE_KEYS:
        value = raw.get(key)
        if isinstance(value, str):
            try:
                re.compile(value)  # peft matches a string with re.fullmatch
            except (re.error, RecursionError, OverflowError) as exc:
                raise SourceError(
                    f"{config}: {key} {excerpt(value)} is not a regular expression ({exc})"
                ) from None
        elif value is not None and not (
            isinstance(value, list) and all(isinstance(n, str) for n in value)
        ):
            raise SourceError(
                f"{config}: {key} {excerpt(value)} is neither a list of module names nor a "
                "regular expression"
            )
    saved = raw.get("modules_to_save")
    if saved is not None and not (
        isinstance(saved, list) and all(isinstance(n, str) for n in saved)
    ):
        raise SourceError(
            f"{config}: modules_to_save {excerpt(saved)} is not a list of module names"
        )
    if raw.get("bias", "none") not in _BIASES:
        raise SourceError(
            f"{config}: bias {excerpt(raw['bias'])} is none of {', '.join(map(repr, _BIASES))}"
        )


def _lora_config(config: Path, raw: dict):
    """peft's ``LoraConfig`` of the document already read (not read again from disk)."""
    peft = import_peft()
    fields = {k: v for k, v in raw.items() if k != "runtime_config"}  # peft drops it too
    try:
        lora = peft.LoraConfig.from_peft_type(**fields)
    except Exception as exc:  # any field of a file peft could not take: the file's fault
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SourceError(
            f"{config}: peft refuses it ({type(exc).__name__}: {cut(first)})"
        ) from None
    lora.inference_mode = False  # the adapter trains
    return lora


def _base_folder(path: Path, ref) -> Path:
    if not isinstance(ref, str) or not ref:
        raise SourceError(
            f"{path}/{CONFIG} names no base model; set base_model_name_or_path to its folder"
        )
    for candidate in (path / ref, Path(ref)):  # an absolute ref is itself either way
        if _exists(candidate):
            if candidate.is_dir() and is_adapter_folder(candidate):
                what = (
                    "this adapter folder itself"
                    if candidate.resolve() == path.resolve()
                    else f"the adapter folder {candidate}"
                )
                raise SourceError(
                    f"{path}/{CONFIG}: base_model_name_or_path {excerpt(ref)} is {what}, not "
                    "a base model; set it to the base model's folder"
                )
            return candidate
    raise SourceError(
        f"{path}: the adapter's base {excerpt(ref)} is not a local folder (yafsdp does not "
        f"download); download it and set base_model_name_or_path in {CONFIG} to its path"
    )


def _described(model: AdaptedModel, path: Path, base: Path, config) -> AdaptedModel:
    note = f"a PEFT adapter folder over the base {base}"
    notes = (*model.spec.notes, note)
    model.spec = replace(model.spec, source=str(path), source_kind="peft", notes=notes)
    model.path = path
    return model


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the system, a NUL in it
        return False
