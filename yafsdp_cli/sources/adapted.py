"""A source as fine-tuning trains it: LoRA adapters added, frozen parameters marked,
a quantized base packed.

``adapt(loaded, step)`` returns a ``LoadedModel`` whose module, spec and real build
all describe the same model: the base with peft's LoRA layers in it (``--lora``, or
the adapter of a PEFT folder, ``peft_folder.py``), and ``requires_grad`` off for every
parameter that does not train (the base under LoRA, and whatever ``--freeze``
matches). The training step then gives a frozen parameter no gradient and no
optimizer state, and the flat layout puts it in a buffer of its own (one per unit,
dtype and trainable).

The adapter is built by peft itself, on the meta device for the spec and the fake
step and on the real base for a real step (seeded, so two builds agree), so its
shapes, dtypes and forward are peft's. The meta build is made under
``torch.device("meta")``, since peft makes each LoRA matrix where the device context
says and only then moves it beside its base layer: a spec of any rank costs no
memory. The meta build is also where the rank is checked against the layers peft
targets (a rank above min(in_features, out_features) of every one adds nothing a
layer can learn; refusing it bounds each LoRA matrix of a real build by its layer's
side times the widest adapted layer's smaller side) and an adapter folder's weights
against the shapes peft gives them, before any real build. The module is peft's
``LoraModel.model``: the base module with LoRA layers in place, under the base's own
names (``model.layers.0.self_attn.q_proj.base_layer.weight``); a ``PeftModel``
wrapper adds no tensors. Base weights keep their stored dtypes (the spec's); peft
keeps the adapter in float32.

``--quantize`` (QLoRA's base) puts ``engine.packed_linear.PackedLinear`` where
bitsandbytes' layers would be, in every frozen linear layer but the output head: it
holds the packed tensors of bitsandbytes' documented format, and its kernels are
stood in for, so a quantized model runs in fake steps only and its notes say what is
estimated.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any

from ..engine.filters import describe, parse_filter
from ..engine.records import ModelSpec
from ..errors import FilterError, SourceError, YafsdpError, cut, excerpt
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
    """``base`` with ``lora`` (a peft ``LoraConfig``, or None), ``freeze`` and, with
    ``quantize``, its frozen linear layers packed (``engine.packed_linear``)."""

    base: Any = None  # the LoadedModel it adapts
    lora: Any = None  # peft.LoraConfig
    lora_text: str | None = None  # --lora as given; None: from an adapter folder or none
    adapter_state: Any = None  # the adapter folder's weights: peft_folder.AdapterWeights
    freeze: tuple[str, ...] = ()
    quantize: str | None = None  # engine.packed.KINDS
    quantized: tuple[str, ...] = ()  # the linear layers packed
    tuning_notes: tuple[str, ...] = ()  # what trains, what is estimated (in spec.notes too)
    tuning_brief: tuple[str, ...] = ()  # the same in a few words, for a report's first lines

    def stored_name(self, record) -> str:
        """As the base stores ``record``; a LoRA model's own tensors (the adapter's, and
        the base layers peft renamed ``base_layer``) are stored by no file under those
        names, so what copies a source's stored bytes (convert) is told to take the base."""
        if self.lora is not None and any("lora_" in n or ".base_layer." in n for n in record.names):
            raise SourceError(
                f"{self.spec.source}: {excerpt(record.name)} is a LoRA model's tensor, held "
                "by no stored file under that name, so no flat checkpoint is written from "
                f"it; convert its base ({self.base.spec.source})"
            )
        return super().stored_name(record)

    def build_module(self):
        """The real base with the adapter (the folder's weights where there are) and the
        frozen parameters marked."""
        if self.quantize is not None:
            raise YafsdpError(
                f"--quantize {self.quantize}: bitsandbytes' kernels are stood in for, in "
                "fake steps only; add --fake (plan and check run fake steps)"
            )
        module = self.base.build_module()
        if self.lora is not None:
            where = lora_source(self.lora_text, self.adapter_state)
            module = inject_lora(module, self.lora, self.adapter_state, where)
        mark_frozen(module, self.spec)
        return module


def adapt(loaded: LoadedModel, step) -> LoadedModel:
    """``loaded`` as ``step`` (a ``StepOptions``) fine-tunes it; itself where the step
    asks nothing (an adapted model stays adapted), or where it was adapted for the
    same options already."""
    lora_text, freeze, quantize = step.lora, tuple(step.freeze), step.quantize
    if lora_text is None and not freeze and quantize is None:
        return loaded
    if not isinstance(loaded, AdaptedModel):
        lora = lora_config(lora_text) if lora_text is not None else None
        return adapted(loaded, lora, lora_text, None, freeze, quantize)
    same = (loaded.freeze, loaded.quantize) == (freeze, quantize)
    if same and lora_text in (None, loaded.lora_text):
        return loaded
    if lora_text is not None and loaded.lora is not None and loaded.lora_text is None:
        raise YafsdpError(
            f"{loaded.spec.source}: the source is a PEFT adapter already; --lora would "
            "add a second one (leave --lora out)"
        )
    lora = loaded.lora if lora_text is None else lora_config(lora_text)
    text = loaded.lora_text if lora_text is None else lora_text
    return adapted(loaded.base, lora, text, loaded.adapter_state, freeze, quantize)


def keeps_stored_base(loaded: LoadedModel) -> bool:
    """Whether the frozen parameters keep their stored dtype under ``--param-dtype``:
    under a LoRA adapter or packed they do (the base is loaded as stored and only the
    adapter trains); a model frozen in part without either trains in one dtype."""
    return isinstance(loaded, AdaptedModel) and (
        loaded.lora is not None or loaded.quantize is not None
    )


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


def adapted(
    base: LoadedModel, lora, lora_text, adapter_state, freeze, quantize=None
) -> AdaptedModel:
    """The ``AdaptedModel`` of ``base``: its meta module and spec (see the module
    docstring)."""
    module = base.module
    if module is None and (lora is not None or quantize is not None):
        raise SourceError(
            f"{base.spec.source}: LoRA and --quantize need the model's architecture; give "
            "a Hugging Face folder with config.json or --model package.module:factory"
        )
    quantized: tuple[str, ...] = ()
    if module is not None:  # marked frozen below: the source's stays as loaded
        module = meta_copy(module) if lora is not None else copy.deepcopy(module)
    if module is not None and lora is not None:
        module = inject_lora(module, lora, adapter_state, lora_source(lora_text, adapter_state))
    spec = _spec(base, module, freeze)
    if module is not None:
        mark_frozen(module, spec)
    if quantize is not None:
        quantized = _quantize(module, quantize)
        spec = _spec(base, module, freeze)
    notes = _tuning_notes(spec, lora, quantize, quantized)
    brief = _tuning_brief(spec, lora, freeze, quantize)
    spec = dataclasses.replace(spec, notes=(*spec.notes, *notes))
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
        quantize=quantize,
        quantized=quantized,
        tuning_notes=notes,
        tuning_brief=brief,
    )


def _tuning_notes(spec, lora, quantize, quantized) -> tuple[str, ...]:
    """What the report says about the fine-tuning: what trains, what is estimated."""
    params = spec.params
    frozen = sum(t.numel for t in params if not t.requires_grad)
    total = sum(t.numel for t in params)
    notes = [
        f"fine-tuning: {total - frozen:,} of {total:,} parameter elements train; the "
        "frozen ones have no gradient and no optimizer state"
    ]
    if lora is not None:
        notes.append(
            f"LoRA by peft: r={lora.r}, alpha={lora.lora_alpha} on {_targets(spec, lora)}; "
            "the base keeps its stored dtype, the adapter is float32 as peft makes it"
        )
    if quantize is not None:
        notes.append(
            f"estimated, not measured: {len(quantized)} frozen linear layers "
            f"quantized {quantize} as bitsandbytes packs them (bytes from its "
            "documented format); its kernels are stood in for: each weight is "
            "dequantized in forward and again in backward, as its matmul does, and "
            "kernel workspaces are not counted"
        )
    return tuple(notes)


def _tuning_brief(spec, lora, freeze, quantize) -> tuple[str, ...]:
    """What trains and what is estimated in a few words each (the notes say it in
    full): a first screen's ``assumed:`` line names these beside the dtypes."""
    brief = []
    if lora is not None:
        brief.append(f"LoRA r={lora.r} on {_targets(spec, lora)}")
    if quantize is not None:  # bitsandbytes' documented format, not a measured model
        brief.append(f"{quantize} base (estimated: bitsandbytes packing)")
    if freeze:
        brief.append("frozen: " + ", ".join(freeze))
    return tuple(brief)


def _targets(spec, lora) -> str:
    """The layers ``lora`` adapts, as a comma list."""
    targets = lora.target_modules
    if targets is None:  # peft's defaults for the architecture: the layers it adapted
        params = spec.params
        adapted = (t.name.partition(".lora_A.")[0] for t in params if ".lora_A." in t.name)
        targets = {name.rpartition(".")[2] for name in adapted}
    return targets if isinstance(targets, str) else ",".join(sorted(targets))


def _quantize(module, kind: str) -> tuple[str, ...]:
    """The frozen linear layers of ``module`` packed; the output head stays as it is,
    as transformers' bitsandbytes integration keeps it."""
    from ..engine.packed_linear import quantize_frozen_linears

    head = getattr(module, "get_output_embeddings", lambda: None)()
    done = quantize_frozen_linears(module, kind, {id(head)} if head is not None else set())
    if not done:
        raise YafsdpError(
            f"--quantize {kind}: no frozen linear layer to pack; it packs the base under "
            "--lora (or what --freeze matches)"
        )
    return tuple(done)


def lora_source(lora_text: str | None, weights) -> str:
    """Where an adapter's settings come from, as a message names it."""
    if lora_text is not None:
        return f"--lora {excerpt(lora_text)}"
    return str(weights.config) if weights is not None else "the LoRA adapter"


def meta_copy(module):
    """A copy of ``module`` on the meta device: the spec's, which holds no memory. A
    meta module is deep-copied as it is; a real one (a pickled module) has its
    tensors replaced by meta ones of the same shapes, ties kept, without copying
    their data first."""
    import torch

    tensors = [*module.parameters(), *module.buffers()]
    if all(t.is_meta for t in tensors):
        return copy.deepcopy(module)
    memo: dict[int, Any] = {}
    for t in tensors:
        empty = torch.empty_like(t, device="meta")
        if isinstance(t, torch.nn.Parameter):
            empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
        memo[id(t)] = empty
    return copy.deepcopy(module, memo)


def inject_lora(module, lora, weights=None, where: str = "the LoRA adapter"):
    """``module`` with peft's LoRA layers, its other parameters frozen; peft's
    ``LoraModel.model``. On a meta ``module`` the LoRA layers are made on the meta
    device and their ranks checked; ``weights`` (an adapter folder's
    ``AdapterWeights``) are checked by shape there and loaded into a real one.
    ``where`` names the settings in messages."""
    import torch

    peft = import_peft()
    meta = all(p.is_meta for p in module.parameters())
    device = torch.device("meta") if meta else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), device:
        # peft asks transformers a deprecated question (is_gradient_checkpointing):
        # the user's output should carry the figures, not that
        warnings.simplefilter("ignore", FutureWarning)
        # nor that an adapter folder's relative base path was made absolute
        warnings.filterwarnings("ignore", "The PEFT config's `base_model_name_or_path`")
        torch.manual_seed(ADAPTER_SEED)
        try:
            wrapped = peft.get_peft_model(module, copy.deepcopy(lora))
        except (ValueError, TypeError, re.error) as exc:  # peft: no target found, bad config
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise YafsdpError(f"{where}: {cut(first)}") from None
        except Exception as exc:
            if weights is None:  # --lora, checked already: not the user's to fix
                raise
            # an adapter folder's config is a file's: whatever peft cannot build from it
            first = (str(exc).strip().splitlines() or [""])[0]
            raise SourceError(
                f"{where}: peft cannot build this adapter ({type(exc).__name__}: {cut(first)})"
            ) from None
    if meta:
        _check_ranks(peft, wrapped, where)
    if weights is not None:
        state = weights.shapes() if meta else weights.load()
        _check_shapes(peft, wrapped, state, weights)
        if not meta:
            _load_adapter(peft, wrapped, state, weights)
    return wrapped.base_model.model


def _check_ranks(peft, wrapped, where: str) -> None:
    """Refuse a rank above min(in_features, out_features) of every layer it adapts:
    such a rank adds nothing any layer can learn, and refusing it bounds each LoRA
    matrix of a real build by its layer's side times the widest adapted layer's
    smaller side."""
    layers = []
    for name, m in wrapped.base_model.model.named_modules():
        if isinstance(m, peft.tuners.lora.LoraLayer):
            sides = (getattr(m, "in_features", None), getattr(m, "out_features", None))
            if all(isinstance(n, int) for n in sides) and m.r:
                layers.append((min(sides), name, sides, max(m.r.values())))
    if not layers:
        return
    widest = max(layers, key=lambda layer: layer[0])  # the first of the widest
    side, wname, (n_in, n_out), _ = widest
    for _, _, _, rank in layers:
        if rank > side:
            raise YafsdpError(
                f"{where}: r={rank} is above min(in_features, out_features) of every layer "
                f"it adapts (at most {side}: {wname} is {n_in} x {n_out}); such a rank adds "
                "nothing a layer can learn"
            )


def _check_shapes(peft, wrapped, state, weights) -> None:
    """Each tensor of the adapter's file against the shape peft gives it here (its
    layer's features, the config's r), named as peft saves them."""
    expected = peft.get_peft_model_state_dict(wrapped, save_embedding_layers=False)
    for name, tensor in state.items():
        want = expected.get(name)
        if want is not None and tuple(want.shape) != tuple(tensor.shape):
            raise SourceError(
                f"{weights.path}: {excerpt(name)} has shape {list(tensor.shape)}, but the base "
                f"and {weights.config.name} make it {list(want.shape)}"
            )


def _load_adapter(peft, wrapped, state, weights) -> None:
    try:
        result = peft.set_peft_model_state_dict(wrapped, state)
    except RuntimeError as exc:  # a shape the check above could not match by name
        first = (str(exc).strip().splitlines() or [""])[-1].strip()
        raise SourceError(
            f"{weights.path}: the adapter's weights do not fit the base ({cut(first)})"
        ) from None
    missing = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
    if missing:
        raise SourceError(
            f"{weights.path}: the adapter's weights do not fit the base: {excerpt(missing[0])}"
        )


def _spec(base: LoadedModel, module, freeze: tuple[str, ...]) -> ModelSpec:
    """The adapted module's spec, base tensors in their stored dtypes, and
    ``requires_grad`` off for what does not train."""
    if module is None or not _changed(module):
        spec = base.spec
    else:
        from ..engine.module_spec import spec_from_module

        found = spec_from_module(module, source=base.spec.source)
        stored = base.spec.by_name()
        tensors = []
        for t in found.tensors:
            record = stored.get(t.name.replace(".base_layer.", "."))
            if record is not None and record.shape == t.shape and t.floating:  # not packed
                t = dataclasses.replace(t, dtype=record.dtype)
            tensors.append(t)
        spec = dataclasses.replace(
            base.spec,
            tensors=tuple(tensors),
            units=found.units,
            module_names=found.module_names,
        )
    return _frozen_spec(spec, freeze)


def _changed(module) -> bool:
    """Whether ``module`` has tensors its base has not (LoRA's, packed ones)."""
    from ..engine.packed_linear import PackedLinear

    return any("lora_" in name for name, _ in module.named_parameters()) or any(
        isinstance(m, PackedLinear) for m in module.modules()
    )


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
