"""Units: the modules that get flat buffers of their own.

YaFSDP gives each transformer block its own buffer so that only one block's
parameters are gathered at a time. By default the units are the repeated blocks:
with an architecture, the children of the largest ``ModuleList`` (see
``module_spec.detect_units``); from names alone, the numbered prefixes such as
``model.layers.N`` that cover the most elements. Beside them, a module outside the
blocks that outweighs one (an embedding, an untied head) is a unit of its own
(``split_units``). Everything else goes to the root unit, named ``""``.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ..errors import FilterError
from .records import ModelSpec, TensorRecord

ROOT = ""

_NUMBERED = re.compile(r"(?:^|\.)(\d+)(?=\.)")


def name_prefixes(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b"]``: the module names a tensor name implies."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def detect_units_from_names(tensors: Sequence[TensorRecord]) -> tuple[str, ...]:
    """Numbered container prefixes (``model.layers.0``...) covering the most elements
    (and a second stack at least half as large, see ``pick_stacks``).

    A pattern counts only if it has at least two indices and the suffixes they all
    share include a nested one: a container block (T5's first block may hold one
    tensor more than the others), not a single layer such as the ``Linear``
    children of an ``nn.Sequential``.
    """
    # pattern "model.layers.*" -> prefix "model.layers.3" -> suffixes / numel
    suffixes: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    numel: dict[str, int] = defaultdict(int)
    for t in tensors:
        for m in _NUMBERED.finditer(t.name):
            prefix = t.name[: m.end()]
            pattern = t.name[: m.start(1)] + "*"
            suffixes[pattern][prefix].add(t.name[m.end() + 1 :])
            numel[pattern] += t.numel
    candidates = []
    for pattern, blocks in suffixes.items():
        common = set.intersection(*blocks.values())
        if len(blocks) >= 2 and any("." in s for s in common):
            candidates.append((numel[pattern], pattern))
    chosen = pick_stacks(candidates, _patterns_nested)
    first_seen = {p: i for i, p in enumerate(suffixes)}
    units = []
    for pattern in sorted(chosen, key=first_seen.get):
        units += sorted(suffixes[pattern], key=lambda p: int(p.rsplit(".", 1)[-1]))
    return tuple(units)


# Besides the largest stack of blocks, another counts if it holds at least this share
# of the largest's elements and does not overlap a chosen one: an encoder beside its
# decoder, but not a small vision tower or a block's expert list.
SECOND_STACK_SHARE = 0.5


def pick_stacks(candidates: list[tuple[int, str]], overlap) -> list[str]:
    """From (numel, name) candidates, the stacks to split into units."""
    chosen: list[str] = []
    ranked = sorted(candidates, key=lambda c: -c[0])
    for size, name in ranked:
        if chosen and size < SECOND_STACK_SHARE * ranked[0][0]:
            break
        if not any(overlap(name, other) for other in chosen):
            chosen.append(name)
    return chosen


def _patterns_nested(a: str, b: str) -> bool:
    """``model.layers.*`` and ``model.layers.0.mlp.experts.*`` overlap."""
    a0, b0 = a[:-1], b[:-1]  # drop the trailing "*"
    return a0.startswith(b0) or b0.startswith(a0)


def resolve_unit_globs(globs: Iterable[str], module_names: Sequence[str]) -> tuple[str, ...]:
    """Modules matched by ``--unit`` globs; a module inside another match is dropped.

    Globs use ``fnmatch`` rules, so ``model.layers.*`` matches ``model.layers.0`` and
    everything below it; keeping only the outermost match makes that the block.
    """
    matched: set[str] = set()
    for glob in globs:
        hits = {m for m in module_names if m and fnmatch.fnmatchcase(m, glob)}
        if not hits:
            examples = ", ".join(example_names(module_names))
            raise FilterError(f"--unit {glob!r} matches no module; modules look like: {examples}")
        matched |= hits
    outer = [m for m in module_names if m in matched and not _inside_any(m, matched)]
    return tuple(dict.fromkeys(outer))


def _inside_any(module: str, others: set[str]) -> bool:
    return any(p in others for p in name_prefixes(module))


def example_names(names: Sequence[str], limit: int = 6) -> list[str]:
    """A few representative names: numbered segments folded to ``N``."""
    seen: dict[str, None] = {}
    for n in names:
        if n:
            seen.setdefault(re.sub(r"\.\d+(?=\.|$)", ".N", n))
        if len(seen) >= limit:
            break
    return list(seen)


def assign_units(spec: ModelSpec, units: Sequence[str]) -> dict[str, str]:
    """Canonical tensor name -> unit. A tensor whose owners sit in different units
    (a weight shared across blocks) goes to the root unit."""
    unit_set = set(units)
    out = {}
    for t in spec.tensors:
        homes = {_unit_of_name(n, unit_set) for n in t.names}
        out[t.name] = homes.pop() if len(homes) == 1 else ROOT
    return out


def _unit_of_name(name: str, unit_set: set[str]) -> str:
    for prefix in name_prefixes(name):
        if prefix in unit_set:
            return prefix
    return ROOT


def resolve_units(
    spec: ModelSpec, globs: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(units, split)``: the modules ``--unit`` globs name if given, else the spec's
    detected blocks and the modules ``split_units`` gives units of their own (``split``,
    always empty for given globs: those are the user's units, whole)."""
    if globs:
        return resolve_unit_globs(globs, spec.module_names), ()
    split = split_units(spec, spec.units)
    return (*spec.units, *split), split


def split_units(spec: ModelSpec, blocks: Sequence[str]) -> tuple[str, ...]:
    """The modules outside ``blocks`` that each hold at least as many parameter bytes
    as the largest block and share no tensor with a module elsewhere: an embedding
    and an untied head that outweigh a block (Llama-3-8B's: 1.0 GB each beside a
    block's 436 MB). Left in the root unit, they would be one unit that every rank
    gathers whole, and the flat layout's transient buffers (two all-gather and two
    gradient buffers of its largest unit) would be sized by it; FSDP2 setups shard them
    on their own for the same reason (torchtitan's ``fully_shard`` of the embedding,
    and of the final norm and output). A tied head stays: its weight is the
    embedding's."""
    if not blocks:
        return ()
    unit_of = assign_units(spec, blocks)
    block_bytes: dict[str, int] = defaultdict(int)
    owners: dict[str, int] = defaultdict(int)
    for t in spec.tensors:
        if not t.is_param:
            continue
        unit = unit_of[t.name]
        if unit != ROOT:
            block_bytes[unit] += t.nbytes
            continue
        homes = {n.rpartition(".")[0] for n in t.names}
        if len(homes) == 1 and ROOT not in homes:
            owners[homes.pop()] += t.nbytes
    largest = max(block_bytes.values(), default=0)
    return tuple(m for m, size in owners.items() if largest and size >= largest)
