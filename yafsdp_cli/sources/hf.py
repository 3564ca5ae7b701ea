"""Hugging Face model folders (``config.json`` + weights, or ``config.json`` alone).

The architecture comes from ``transformers`` (the optional ``hf`` extra), built on
the meta device from the config, so a 70B model costs no memory; tied weights are
the module's own (HF ties ``lm_head`` to the embedding in ``from_config``). The
class is the first of ``config.architectures`` that transformers has, else the
causal-LM, seq2seq-LM or base model for the config. The weights (safetensors,
sharded or not, or ``pytorch_model.bin``) must fit that architecture:

- a tied name the checkpoint leaves out (``lm_head.weight``) is fine;
- stored names that differ only by the base-model prefix (``model.``) are mapped;
- stored tensors the model lists in ``_keys_to_ignore_on_load_unexpected`` are
  ignored, persistent buffers the checkpoint lacks are counted as not stored;
- a checkpoint that transformers converts on load (transformers 5 fuses MoE
  experts into one tensor, e.g. Mixtral) is described as the model holds it, and
  its tensors are read through ``from_pretrained`` when bytes are needed.

Without transformers a folder with weights falls back to the weights alone (their
header still gives layout and memory, and needs no torch), with a note naming the
extra; a config-only folder is an error naming it. Code shipped in the folder
(``auto_map``) runs only with ``--trust-pickle``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ..engine.records import ModelSpec
from ..errors import SourceError
from ..fileio import read_json
from .files import load_file, weights_in_folder, with_spec
from .hf_readers import PretrainedReader, RenamedReader, quiet_transformers
from .loaded import LoadedModel

EXTRA = "pip install 'yafsdp-cli[hf]'"


def load_hf_folder(path: Path, *, trust_pickle: bool = False) -> LoadedModel:
    raw = read_config(path / "config.json")
    weights = weights_in_folder(path)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return _without_transformers(path, raw, weights, trust_pickle)
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "quantized")
        raise SourceError(
            f"{path}: a {method} checkpoint (config.json has quantization_config); quantized "
            "weights are not supported, use the unquantized model folder"
        )
    with quiet_transformers():
        cfg = _config(path, trust_pickle)
        stored = _stored_dtype(cfg) is not None  # before building, which sets one
        build = _builder(cfg, path, trust_pickle)
        module = _build_meta(build, path)
    from ..engine.module_spec import spec_from_module

    arch = spec_from_module(module, source=str(path), source_kind="hf")
    factory = _RealBuilder(build)
    if weights is None:
        dtype = _dtype_name(cfg) if stored else "none stored"
        note = (
            f"config.json alone: {type(module).__name__} built on the meta device from the "
            f"config, no weights; dtypes from the config ({dtype})"
        )
        spec = replace(arch, notes=(*arch.notes, note), dtype_stored=stored)
        return LoadedModel(spec=spec, module=module, factory=factory, path=path)
    return _with_weights(path, weights, module, arch, factory, build, trust_pickle)


def read_config(path: Path) -> dict:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise SourceError(f"{path}: not a JSON object; is this a Hugging Face config?")
    return raw


def _without_transformers(path: Path, raw: dict, weights: Path | None, trust: bool):
    kind = raw.get("model_type", "unknown")
    if weights is None:
        raise SourceError(
            f"{path} holds only config.json (model_type {kind!r}); building its architecture "
            f"needs transformers: {EXTRA}"
        )
    loaded = load_file(weights, trust)
    hint = f"config.json is here but transformers is not installed: {EXTRA}"
    note = f"Hugging Face folder read as its weights alone ({hint})"
    loaded = with_spec(loaded, replace(loaded.spec, notes=(note, *loaded.spec.notes)))
    loaded.extra["architecture_hint"] = hint
    loaded.factory = _MissingExtra(hint)
    return loaded


class _MissingExtra:
    """Stands in for the architecture when transformers is absent; says what to do."""

    def __init__(self, hint: str):
        self.hint = hint

    def __call__(self):
        raise SourceError(f"running this model needs its architecture: {self.hint}")


def _config(path: Path, trust: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise SourceError(
            f"{path}/config.json: transformers cannot read it ({_why(exc)})"
        ) from None


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "trust_remote_code" in text:
        return (
            "the folder ships its own modelling code; pass --trust-pickle to run it, "
            "if you trust it"
        )
    return text[:300]


def _builder(cfg, path: Path, trust: bool):
    """A callable ``build() -> nn.Module`` for the config's architecture."""
    import transformers

    for name in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return _ClassBuilder(cls, cfg)
    if getattr(cfg, "auto_map", None) and not trust:
        raise SourceError(
            f"{path}: the architecture is the folder's own code (auto_map in config.json); "
            "pass --trust-pickle to run it, if you trust it"
        )
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        auto_cls = getattr(transformers, auto)
        if trust and getattr(cfg, "auto_map", None):
            if auto in cfg.auto_map:
                return _AutoBuilder(auto_cls, cfg)
            continue
        if type(cfg) in auto_cls._model_mapping:
            return _ClassBuilder(auto_cls._model_mapping[type(cfg)], cfg)
    raise SourceError(
        f"{path}: transformers has no model class for model_type "
        f"{getattr(cfg, 'model_type', None)!r}; name one in config.json 'architectures'"
    )


def _dtype_kw(dtype) -> dict:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def _stored_dtype(cfg):
    """The config's dtype (``dtype``, or ``torch_dtype`` before transformers 5), or
    None where it records none (transformers 5 saves a config built in code without
    one)."""
    import torch

    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype != "auto" else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _config_dtype(cfg):
    import torch

    return _stored_dtype(cfg) or torch.float32


def _dtype_name(cfg) -> str:
    return str(_config_dtype(cfg)).removeprefix("torch.")


class _ClassBuilder:
    def __init__(self, cls, cfg):
        self.cls, self.cfg = cls, cfg

    def __call__(self):
        return self.cls._from_config(self.cfg, **_dtype_kw(_config_dtype(self.cfg)))

    def pretrained(self, path: Path):
        return self.cls.from_pretrained(path, local_files_only=True, **_dtype_kw("auto"))


class _AutoBuilder(_ClassBuilder):
    def __call__(self):
        kw = _dtype_kw(_config_dtype(self.cfg))
        return self.cls.from_config(self.cfg, trust_remote_code=True, **kw)

    def pretrained(self, path: Path):
        kw = _dtype_kw("auto")
        return self.cls.from_pretrained(path, trust_remote_code=True, local_files_only=True, **kw)


class _RealBuilder:
    """``LoadedModel.factory``: the same architecture, for real, on the CPU."""

    def __init__(self, build):
        self.build = build

    def __call__(self):
        with quiet_transformers():
            return self.build()

    @property
    def config(self):
        """The transformers config the architecture is built from."""
        return self.build.cfg

    def with_config(self, cfg) -> _RealBuilder:
        """The same model class built from another config (``verify --blocks``)."""
        return _RealBuilder(type(self.build)(self.build.cls, cfg))


def _build_meta(build, path: Path):
    import torch

    try:
        with torch.device("meta"):
            return build()
    except Exception as exc:
        raise SourceError(
            f"{path}: building the architecture from config.json failed "
            f"({type(exc).__name__}: {_why(exc)})"
        ) from None


# ---------------------------------------------------------------- weights


def _with_weights(path, weights, module, arch, factory, build, trust) -> LoadedModel:
    from .factory import fit_weights

    stored = load_file(weights, trust)
    label = f"{type(module).__name__} from {path.name}/config.json"
    ignored = _ignored_unexpected(module, stored.spec, arch)
    renamed, mapping = _match_prefix(stored.spec, arch, _prefix(module), ignored)
    arch = _unstored_buffers(arch, renamed)
    try:
        spec = fit_weights(arch, renamed, label=label)
    except SourceError:
        if not _converts_on_load(module):
            raise
        return _converted(path, module, arch, stored.spec, factory, build)
    notes = [f"architecture {type(module).__name__} from config.json; weights from {weights.name}"]
    if ignored:
        notes.append(f"ignored {len(ignored)} stored tensors the model does not use")
    if mapping:
        notes.append(f"stored names differ by the {_prefix(module)!r} prefix; mapped")
    reader = RenamedReader(stored.reader, mapping) if mapping else stored.reader
    spec = replace(spec, notes=(*spec.notes, *notes), metadata=stored.spec.metadata)
    return LoadedModel(spec=spec, reader=reader, module=module, factory=factory, path=path)


def _prefix(module) -> str:
    return getattr(module, "base_model_prefix", "") or ""


def _ignored_unexpected(module, stored: ModelSpec, arch: ModelSpec) -> set[str]:
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()
    known = arch.by_name()
    return {
        n
        for t in stored.tensors
        for n in t.names
        if n not in known and any(re.search(p, n) for p in patterns)
    }


def _match_prefix(stored: ModelSpec, arch: ModelSpec, prefix: str, ignored: set[str]):
    """The stored spec renamed to the architecture's names where only the base-model
    prefix differs; returns it and {architecture name: stored name}."""
    known = arch.by_name()
    kept = [t for t in stored.tensors if t.name not in ignored]
    if not prefix or all(n in known for t in kept for n in t.names):
        return replace(stored, tensors=tuple(kept)), {}
    p = prefix + "."
    candidates = (lambda n: p + n, lambda n: n.removeprefix(p))
    best, best_hits = None, sum(n in known for t in kept for n in t.names)
    for f in candidates:
        hits = sum(f(n) in known for t in kept for n in t.names)
        if hits > best_hits:
            best, best_hits = f, hits
    if best is None:
        return replace(stored, tensors=tuple(kept)), {}
    renamed = tuple(
        replace(t, name=best(t.name), aliases=tuple(best(a) for a in t.aliases)) for t in kept
    )
    mapping = {best(n): n for t in kept for n in t.names}
    return replace(stored, tensors=renamed), mapping


def _unstored_buffers(arch: ModelSpec, stored: ModelSpec) -> ModelSpec:
    """Persistent module buffers the checkpoint lacks are not stored: HF rebuilds them."""
    have = stored.by_name()
    tensors = tuple(
        replace(t, persistent=False)
        if not t.is_param and t.persistent and not any(n in have for n in t.names)
        else t
        for t in arch.tensors
    )
    return replace(arch, tensors=tensors)


def _converts_on_load(module) -> bool:
    """Whether transformers rewrites this model's checkpoint names on load (v5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return False
    try:
        return bool(get_model_conversion_mapping(module, add_legacy=False))
    except Exception:
        return False


def _converted(path, module, arch, stored: ModelSpec, factory, build) -> LoadedModel:
    dtypes_seen = Counter(t.dtype for t in stored.params if t.floating)
    stored_dtype = dtypes_seen.most_common(1)[0][0] if dtypes_seen else None
    if stored_dtype:
        arch = replace(
            arch,
            tensors=tuple(
                replace(t, dtype=stored_dtype) if t.is_param and t.floating else t
                for t in arch.tensors
            ),
        )
    note = (
        f"the checkpoint's tensors differ from {type(module).__name__}'s in this transformers "
        "version, which converts them on load (renamed or fused tensors, e.g. MoE experts); "
        f"described as the model holds them, in the stored dtype ({stored_dtype}); bytes are "
        "read through from_pretrained"
    )
    spec = replace(arch, notes=(*arch.notes, note), metadata=stored.metadata)
    reader = PretrainedReader(build, path)
    return LoadedModel(spec=spec, reader=reader, module=module, factory=factory, path=path)
