"""A source as fine-tuning trains it: LoRA adapters added, frozen parameters marked.

``adapt(loaded, step)`` returns a ``LoadedModel`` whose module, spec and real build
all describe the same model: the base with peft's LoRA layers in it (``--lora``, or
the adapter of a PEFT folder, ``peft_folder.py``), and ``requires_grad`` off for every
parameter that does not train (the base under LoRA, and whatever ``--freeze``
matches). The training step then gives a frozen parameter no gradient and no
optimizer state, and the flat layout puts it in a buffer of its own (one per unit,
dtype and trainable).

The adapter is built by peft itself, on the meta device for the spec and the fake
step and on the real base for a real step (seeded, so two builds agree), so its
shapes, dtypes and forward are peft's. The module is peft's ``LoraModel.model``: the
base module with LoRA layers in place, under the base's own names
(``model.layers.0.self_attn.q_proj.base_layer.weight``); a ``PeftModel`` wrapper adds
no tensors. Base weights keep their stored dtypes (the spec's); peft keeps the
adapter in float32.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..engine.filters import describe, parse_filter
from ..engine.records import ModelSpec
from ..errors import FilterError, SourceError, YafsdpError
from .loaded import LoadedModel

PEFT_EXTRA = "pip install 'yafsdp-cli[peft]'"
ADAPTER_SEED = 0  # peft initialises lora_A at random: one seed, so builds agree


def import_peft():
    """peft, or the one-line error naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise YafsdpError(f"LoRA needs the peft package: {PEFT_EXTRA}") from None
    return peft


@dataclass
class AdaptedModel(LoadedModel):
    """``base`` with ``lora`` (a peft ``LoraConfig``, or None) and ``freeze``."""

    base: Any = None  # the LoadedModel it adapts
    lora: Any = None  # peft.LoraConfig
    lora_text: str | None = None  # --lora as given; None: from an adapter folder or none
    adapter_state: Any = None  # callable -> the adapter folder's weights (a state dict)
    freeze: tuple[str, ...] = ()

    def build_module(self):
        """The real base with the adapter (the folder's weights where there are) and the
        frozen parameters marked."""
        module = self.base.build_module()
        if self.lora is not None:
            state = self.adapter_state() if self.adapter_state is not None else None
            module = inject_lora(module, self.lora, state)
        mark_frozen(module, self.spec)
        return module


def adapt(loaded: LoadedModel, step) -> LoadedModel:
    """``loaded`` as ``step`` (a ``StepOptions``) fine-tunes it; itself where the step
    asks nothing (an adapted model stays adapted), or where it was adapted for the
    same options already."""
    lora_text, freeze = step.lora, tuple(step.freeze)
    if lora_text is None and not freeze:
        return loaded
    if isinstance(loaded, AdaptedModel):
        if loaded.freeze == freeze and lora_text in (None, loaded.lora_text):
            return loaded
        if lora_text is not None and loaded.lora is not None and loaded.lora_text is None:
            raise YafsdpError(
                f"{loaded.spec.source}: the source is a PEFT adapter already; --lora would "
                "add a second one (leave --lora out)"
            )
        lora = loaded.lora if lora_text is None else lora_config(lora_text)
        text = loaded.lora_text if lora_text is None else lora_text
        return adapted(loaded.base, lora, text, loaded.adapter_state, freeze)
    lora = lora_config(lora_text) if lora_text is not None else None
    return adapted(loaded, lora, lora_text, None, freeze)


def keeps_stored_base(loaded: LoadedModel) -> bool:
    """Whether the frozen parameters keep their stored dtype under ``--param-dtype``:
    under a LoRA adapter they do (the base is loaded as stored and only the adapter
    trains); a model frozen in part without one trains in one dtype."""
    return isinstance(loaded, AdaptedModel) and loaded.lora is not None


def lora_config(text: str):
    """peft's ``LoraConfig`` for ``--lora TEXT``."""
    from ..engine.finetune import parse_lora

    settings = parse_lora(text)
    peft = import_peft()
    targets = settings.targets
    return peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets[0] if targets == ("all-linear",) else list(targets),
    )


def adapted(base: LoadedModel, lora, lora_text, adapter_state, freeze) -> AdaptedModel:
    """The ``AdaptedModel`` of ``base``: its meta module and spec (see the module
    docstring)."""
    module = base.module
    if module is None and lora is not None:
        raise SourceError(
            f"{base.spec.source}: LoRA needs the model's architecture; give a Hugging Face "
            "folder with config.json or --model package.module:factory"
        )
    if module is not None:
        module = copy.deepcopy(module)  # marked frozen below: the source's stays as loaded
    if module is not None and lora is not None:
        module = inject_lora(module, lora, None)
    spec = _spec(base, module, freeze)
    if module is not None:
        mark_frozen(module, spec)
    return AdaptedModel(
        spec=spec,
        reader=base.reader,
        module=module,
        factory=base.factory,
        path=base.path,
        base=base,
        lora=lora,
        lora_text=lora_text,
        adapter_state=adapter_state,
        freeze=freeze,
    )


def inject_lora(module, lora, state):
    """``module`` with peft's LoRA layers (``state``: adapter weights to load, as
    peft saves them), its other parameters frozen; peft's ``LoraModel.model``."""
    import torch

    peft = import_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ADAPTER_SEED)
        try:
            wrapped = peft.get_peft_model(module, copy.deepcopy(lora))
        except ValueError as exc:  # peft: target modules not found
            first = str(exc).strip().splitlines()[0]
            raise YafsdpError(f"--lora: {first}") from None
    if state is not None:
        result = peft.set_peft_model_state_dict(wrapped, state)
        missing = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
        if missing:
            raise SourceError(f"the adapter's weights do not fit the base: {missing[0]}")
    return wrapped.base_model.model


def _spec(base: LoadedModel, module, freeze: tuple[str, ...]) -> ModelSpec:
    """The adapted module's spec, base tensors in their stored dtypes, and
    ``requires_grad`` off for what does not train."""
    if module is None or module is base.module or not _has_lora(module):
        spec = base.spec
    else:
        from ..engine.module_spec import spec_from_module

        found = spec_from_module(module, source=base.spec.source)
        stored = base.spec.by_name()
        tensors = []
        for t in found.tensors:
            record = stored.get(t.name.replace(".base_layer.", "."))
            tensors.append(t if record is None else dataclasses.replace(t, dtype=record.dtype))
        spec = dataclasses.replace(
            base.spec,
            tensors=tuple(tensors),
            units=found.units,
            module_names=found.module_names,
        )
    return _frozen_spec(spec, freeze)


def _has_lora(module) -> bool:
    return any("lora_" in name for name, _ in module.named_parameters())


def _frozen_spec(spec: ModelSpec, freeze: tuple[str, ...]) -> ModelSpec:
    """``spec`` with ``requires_grad`` off for every parameter a ``freeze`` expression
    matches; one that matches nothing is an error that lists what exists."""
    exprs = [parse_filter(f) for f in freeze]
    for f in exprs:
        if f.needs_architecture and not spec.has_architecture:
            raise FilterError(f"--freeze {f.text!r} needs the model's architecture")
        if not any(f.matches(t) for t in spec.params):
            raise FilterError(f"--freeze {f.text!r} matches no parameter; {describe(spec)}")
    tensors = tuple(
        dataclasses.replace(t, requires_grad=False)
        if t.is_param and any(f.matches(t) for f in exprs)
        else t
        for t in spec.tensors
    )
    return dataclasses.replace(spec, tensors=tensors)


def mark_frozen(module, spec: ModelSpec) -> None:
    """``requires_grad`` of ``module``'s parameters as ``spec`` has it."""
    from ..engine.module_spec import collect_tensors

    trains = {t.name: t.requires_grad for t in spec.params}
    for item in collect_tensors(module):
        if item.is_param and item.names[0] in trains:
            item.tensor.requires_grad_(trains[item.names[0]])
