"""``torch.export`` programs (``*.pt2`` from ``torch.export.save``), where they fit.

``torch.export.load`` unpickles parts of the archive, which can run code, so a
``.pt2`` is read only with ``--trust-pickle``. The program's module
(``ExportedProgram.module()``) holds the parameters and buffers under their
original names; tied parameters come back as separate ``Parameter``s over one
storage, so they are tied again (one object, as in the original). Module kinds
and class names come from the graph's ``nn_module_stack`` (the module each
operation ran in), so kind filters work. Units come from numbered names
(``layers.N``), as the program keeps no ``ModuleList``.

Not supported: AOTInductor packages and other ``.pt2`` archives without an
exported program, and programs without parameters.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from ..engine.records import ModelSpec
from ..engine.units import detect_units_from_names
from ..errors import SourceError


def load_export(path: Path, trust_pickle: bool = False):
    from .loaded import LoadedModel

    if not trust_pickle:
        raise SourceError(
            f"{path} is a torch.export program; torch.export.load unpickles parts of it, which "
            "can run code from the file. Pass --trust-pickle if you trust it"
        )
    program = _load_program(path)
    from ..engine.module_spec import spec_from_module
    from .torch_file import TensorDictReader, module_tensors

    module = program.module()
    tied = retie(module)
    spec = spec_from_module(module, source=str(path), source_kind="torch.export")
    if not spec.params:
        raise SourceError(f"{path}: the exported program has no parameters to lay out")
    spec = _with_graph_owners(spec, program)
    if not spec.units:
        spec = replace(spec, units=detect_units_from_names(spec.tensors))
    notes = ["torch.export program: module kinds and classes from the graph's nn_module_stack"]
    if tied:
        notes.append(f"tied again (one storage in the program): {', '.join(tied)}")
    spec = replace(spec, notes=(*spec.notes, *notes))
    loaded = LoadedModel(
        spec=spec, reader=TensorDictReader(module_tensors(module)), module=module, path=path
    )
    loaded.extra["example_inputs"] = getattr(program, "example_inputs", None)
    return loaded


def _load_program(path: Path):
    import torch

    try:
        program = torch.export.load(path)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SourceError(
            f"{path}: not a loadable torch.export program ({first[:200]}); AOTInductor "
            "packages and other .pt2 archives are not supported"
        ) from None
    if not isinstance(program, torch.export.ExportedProgram):
        raise SourceError(f"{path}: holds a {type(program).__name__}, not an ExportedProgram")
    return program


def retie(module) -> list[str]:
    """Make parameters that view the very same data one ``Parameter`` object again;
    returns the names that became aliases."""
    first: dict[tuple, object] = {}
    aliases = []
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.shape, p.stride(), p.dtype)
        if p.numel() == 0 or key not in first:
            first.setdefault(key, p)
            continue
        if first[key] is not p:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first[key])
            aliases.append(name)
    return aliases


def _with_graph_owners(spec: ModelSpec, program) -> ModelSpec:
    """Each tensor's owner classes and kinds, from the operations that use it."""
    owners = graph_owners(program)
    by_name = spec.by_name()
    types: dict[str, dict[str, None]] = defaultdict(dict)
    for fqn, classes in owners.items():
        record = by_name.get(fqn)
        if record is not None:
            types[record.name].update(dict.fromkeys(classes))
    tensors = tuple(
        replace(
            t,
            module_types=tuple(types[t.name]),
            kinds=tuple(dict.fromkeys(k for c in types[t.name] for k in class_kinds(c))),
        )
        for t in spec.tensors
    )
    return replace(spec, tensors=tensors)


def graph_owners(program) -> dict[str, list[str]]:
    """Parameter/buffer name -> class names of the modules whose operations use it."""
    sig = program.graph_signature
    targets = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    out: dict[str, list[str]] = defaultdict(list)
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in targets:
            continue
        for user in node.users:
            stack = user.meta.get("nn_module_stack") or {}
            if stack:
                _, cls = list(stack.values())[-1]  # the innermost module
                name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
                out[targets[node.name]].append(name.rsplit(".", 1)[-1])
    return out


def class_kinds(cls: str) -> tuple[str, ...]:
    """Filter kinds from a class name, as ``module_spec.module_kinds`` reads them."""
    if cls == "Conv1D" or cls.endswith("Linear"):
        return ("linear",)
    if cls.endswith(("Embedding", "EmbeddingBag")):
        return ("embedding",)
    if cls.startswith(("Conv", "LazyConv")) and cls[-2:] in ("1d", "2d", "3d"):
        return ("conv",)
    if "Norm" in cls:
        return ("norm",)
    return ()
