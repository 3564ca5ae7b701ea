"""What every training scheme answers, whichever it is.

A scheme is one frozen object (``Scheme``): its name, what a rank holds of each part
(``Holds``), its collectives (``Collectives``, what ``timing.comm_volume`` sizes), and
two methods the memory model and ``plan --scheme`` call: ``memory`` (one rank's bytes,
composed from the memory model's parts) and ``phase_peak`` (those bytes at one phase's
peak of the step). This room imports nothing of the package but ``errors``: the memory
model hands a scheme its parts (``memory.step_schemes.SchemeParts``) and its figures
(``MemoryBreakdown``, ``StepAt``, ``SchemeSettings``), so that memory, timing, planning,
inspection and report can all import the schemes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

WHOLE = "whole"  # every rank holds all of it
SHARDED = "sharded"  # every rank holds 1/world_size of it
Holding = Literal["whole", "sharded"]


@dataclass(frozen=True, slots=True)
class Holds:
    """What one rank holds of each part between steps."""

    params: Holding
    grads: Holding
    optimizer: Holding  # optimizer states, and float32 master weights where kept


@dataclass(frozen=True, slots=True)
class Collectives:
    """A step's collectives, in what ``timing.comm_volume`` reads of them."""

    # each unit's parameters all-gathered before its forward, and again before its
    # backward (resharded after forward; the root unit stays gathered)
    gathers_params: bool
    reduces: Literal["reduce_scatter", "all_reduce"]  # the gradients', unit by unit
    # what one collective is: a flat buffer ("buffers"), a unit's parameters as FSDP2
    # places them ("placement"), or a unit's gradients unpadded ("unit_grads")
    sized_by: Literal["buffers", "placement", "unit_grads"]
    # with gradient accumulation: gradients reduced in every micro-batch (and the
    # reduced ones accumulated), or held unreduced and reduced once, in the last
    reduce_every_micro_batch: bool = True


@dataclass(frozen=True)
class Scheme:
    """One training scheme. Compare schemes as objects (``scheme is FLAT``); the
    strings below are what the command line and the JSON documents spell."""

    name: str  # the command line's and plan's JSON spelling (``plan --scheme``)
    label: str  # for people: table headers, answers
    holds: Holds
    collectives: Collectives | None  # None: the step-time model has none for it
    # JSON contract of ``yafsdp.inspect/1`` (``schemas/inspect.schema.json``):
    # ``memory.schemes[].scheme``; None where inspect has no column for the scheme
    inspect_key: str | None = None
    # JSON contract of ``yafsdp.plan/1`` (``schemas/plan.schema.json``): a timed
    # row's ``scheme``, and the name ``timing.comm_volume`` takes; None: not timed
    timing_key: str | None = None
    # what ``plan --scheme`` runs in the fake step for the scheme's rows, in words (the
    # plan's own flat steps, or the engine itself under a fake process group: see
    # ``planning.engine_rows``); None: the rows are modelled from the memory model's
    # parts (``phase_peak``), not run
    engine: str | None = None
    why_modelled: str = ""  # where ``engine`` is None: why the engine is not run

    @property
    def modelled(self) -> bool:
        return self.engine is None

    @property
    def whole_params(self) -> bool:
        """Forward and backward run on whole parameters, as at world size 1."""
        return self.holds.params == WHOLE

    def memory(self, parts):
        """One rank's ``MemoryBreakdown`` at ``parts.world_size`` (``parts``: a
        ``memory.step_schemes.SchemeParts``)."""
        raise NotImplementedError(self.name)

    def phase_peak(self, phase: str, m, step, world_size: int, settings) -> int:
        """One rank's bytes at ``phase``'s peak: what the scheme holds then plus the
        step's own bytes (``m``: ``memory``'s breakdown; ``step``: a ``StepAt``). At
        world size 1 nothing is gathered or reduced, so every scheme holds what the
        reference step holds."""
        if world_size == 1:
            return at_reference(m, step)
        return self.sharded_peak(phase, m, step, world_size, settings)

    def sharded_peak(self, phase: str, m, step, world_size: int, settings) -> int:
        """``phase_peak`` above world size 1: by default the scheme holds what the
        reference holds at the same moments, in its own sizes."""
        return at_reference(m, step)

    def configuration(self, settings) -> str:
        """What the scheme's ``plan --scheme`` rows assume, in its own terms."""
        raise NotImplementedError(self.name)

    def unsynced(self, phase: str, m, whole_grads: int) -> int | None:
        """With gradient accumulation and gradient sync switched off until the last
        micro-batch: the bytes one rank holds at ``phase``'s peak beyond what it holds
        with sync on (``m``: its ``memory`` breakdown above world size 1;
        ``whole_grads``: every gradient whole). None where the scheme has no such
        switch: its rows are the way it accumulates (the flat runtime reduce-scatters
        every micro-batch; DDP's ``no_sync()`` keeps whole gradients, as it always
        does)."""
        return None


def at_reference(m, step) -> int:
    """The scheme's bytes standing where the reference step's model bytes stood."""
    return m.total + step.activations + step.temporaries


def short_count(n: int) -> str:
    """``500_000_000`` -> ``"5e8"``; a number that is not one digit and zeros as it is."""
    text = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")
    return text if float(text) == n else str(n)


def renamed(m, scheme: Scheme, **changes):
    """``m`` (a ``MemoryBreakdown``) as ``scheme``'s, with ``changes``."""
    return dataclasses.replace(m, scheme=scheme, **changes)
