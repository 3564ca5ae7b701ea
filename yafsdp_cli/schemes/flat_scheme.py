"""``flat``: yafsdp's flat layout, as ``engine.sharded`` runs it.

Memory: the memory model's flat column (``memory.estimate``): shards of every flat
buffer, its gradient, optimizer states and master weights, unconverted parameters
whole, and two all-gather and two gradient buffers of the largest unit. At each
phase it holds what the reference step (a fake run of the flat model) holds.

Collectives: forward, an all-gather of every flat buffer, unit by unit (the root
unit's first); backward, units in reverse, an all-gather again of every buffer of a
non-root unit and a reduce-scatter of every trainable buffer's gradient; each
collective the buffer's padded bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import SHARDED, Collectives, Holds, Scheme


@dataclass(frozen=True)
class Flat(Scheme):
    def memory(self, parts):
        return parts.report.flat

    def configuration(self, settings) -> str:
        return "2 all-gather + 2 gradient buffers of the largest unit"


FLAT = Flat(
    name="flat",
    label="yafsdp flat",
    holds=Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED),
    collectives=Collectives(gathers_params=True, reduces="reduce_scatter", sized_by="buffers"),
    inspect_key="yafsdp",
    timing_key="yafsdp",
    engine="yafsdp's flat engine (the plan's own steps)",
)
