"""One configuration's step time, and the best of a list of configurations.

``estimate_step`` combines a step's kernel costs (``step_costs``), the roofline
(``roofline``) and the collectives of a scheme (``comm_volume``) on one GPU model:

- compute: the forward's and backward's kernels on the roofline; every rank runs
  its own micro-batch, so this does not depend on the world size;
- communication, with one unit prefetched: a unit's collectives overlap the
  compute of its neighbour. Each phase's compute is split over the units in
  proportion to their parameter elements (the root unit takes the unconverted
  ones). In forward (units ``u_0 .. u_m`` in order)::

      exposed_fwd = G_0 + sum_k max(0, G_k - C_{k-1})

  (``G_k``: unit ``k``'s all-gather time, ``C_k``: its compute), and in backward
  (units in reverse, ``v_0 .. v_m``)::

      exposed_bwd = G_0 + sum_k max(0, R_{k-1} + G_{k+1} - C_k) + R_m

  (``R_k``: unit ``k``'s reduce-scatter, or DDP's all-reduce, issued when its
  backward ends; the next unit's all-gather is the one prefetched); a stall ends at
  the next unit, whose parameters it waits for;
- the optimizer step: its kernels' time from the fake step's bytes, each kernel's
  share above the floor scaled by the part of the parameters this rank steps (its
  shards: about ``1 / world_size``; all of them under DDP);
- ``step_s = forward + backward + exposed communication + optimizer``;
- with gradient accumulation (``StepCosts.grad_accum`` = N above 1) a step is N
  micro-batches and one optimizer step: the first micro-batch's forward and backward,
  then N - 1 times a later one's (its own kernels, counted, and its adds into the
  gradients held, on this rank's share of them as the optimizer's kernels are: its
  shards where the scheme reduces every micro-batch into sharded gradients, all of
  them where it holds them whole), each with its exposed communication; the
  optimizer once. Parameters are
  all-gathered in every micro-batch; gradients reduced in every micro-batch where
  the scheme does (``Collectives.reduce_every_micro_batch``: the flat runtime and
  FSDP2 with gradient sync on, the default), else once, in the last (DDP's
  ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``). Tokens per step are
  N x micro-batch x sequence length.

``tokens_per_s`` is per GPU; MFU is the model FLOPs (``6 N T``-style useful work:
forward and backward products, attention's full square, no recompute) over the
peak of the dtype most of the step's products run in, times the step time (each
GPU's own micro-batch against its own peak, which is the same ratio as over all
GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.layout import Layout
from ..engine.units import ROOT
from ..errors import YafsdpError
from ..memory.config import MemoryConfig
from ..schemes import FLAT, WHOLE, Scheme
from .comm_volume import Cluster, check_scheme, collectives, ring_time, unit_order
from .gpu_specs import GpuSpec
from .roofline import BOUNDS, Efficiency, PhaseTime, efficiency_for, phase_time
from .step_costs import ACCUMULATE, LATER, StepCosts


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """One configuration's step on one GPU model; seconds, bytes, FLOPs."""

    gpu: str
    scheme: str  # the scheme's timing_key (the plan's JSON spells it so)
    world_size: int
    tokens: int  # per GPU per step: every micro-batch's
    forward_s: float  # every micro-batch's forwards
    backward_s: float  # ... and backwards
    optimizer_s: float
    comm_s: float  # every collective, back to back
    exposed_comm_s: float  # what compute does not hide
    step_s: float
    tokens_per_s: float  # per GPU
    mfu: float
    sent_bytes: int  # per rank per step
    model_flops: int  # per GPU per step
    # the compute (forward + backward + optimizer) by what decides each kernel
    # (``roofline.BOUNDS``: matrix, attention, vector, memory, floor); sums to the three
    compute_bound_s: dict[str, float] = field(default_factory=dict)
    # "communication" where the collectives back to back take longer than the forward
    # and backward they can run behind (only a faster network shortens the step much),
    # else "compute"
    decided_by: str = "compute"

    @property
    def exposed_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def estimate_step(
    costs: StepCosts,
    layout: Layout,
    gpu: GpuSpec,
    *,
    scheme: Scheme | str = FLAT,
    cluster: Cluster | None = None,
    eff: Efficiency | None = None,
    cfg: MemoryConfig | None = None,
    placement: str = "dim0",
    phases: dict[str, PhaseTime] | None = None,
    reduce_every_micro_batch: bool | None = None,
) -> StepEstimate:
    """The step estimate of ``costs`` (one micro-batch, and a later one's kernels where
    it accumulates several) with ``layout``'s world size; ``phases``:
    ``phase_times(costs, gpu, eff)`` where the caller has them (they do not depend on
    the layout, so a grid of world sizes computes them once);
    ``reduce_every_micro_batch``: None for the scheme's own way (its ``Collectives``),
    else whether gradients are reduced in every micro-batch or in the last alone."""
    cluster, eff = cluster or Cluster(), eff or efficiency_for(gpu)
    scheme = check_scheme(scheme)
    n = layout.world_size
    phases = phases or phase_times(costs, gpu, eff)
    fwd, bwd, opt = phases["forward"], phases["backward"], phases["optimizer"]
    floor = opt.kernels * eff.kernel_floor_s
    optimizer_s = (opt.seconds - floor) * _stepped_share(layout, scheme, costs) + floor
    found = collectives(layout, scheme, cfg, placement)
    times = [ring_time(c.kind, c.bytes, n, gpu, cluster) for c in found]
    every = scheme.collectives.reduce_every_micro_batch
    every = every if reduce_every_micro_batch is None else reduce_every_micro_batch
    # how many times a step issues each collective: gathers in every micro-batch,
    # reductions in every one or in the last alone
    accum = costs.grad_accum
    per_step = [accum if every or c.kind == "all_gather" else 1 for c in found]
    exposed = _exposed(layout, found, times, fwd.seconds, bwd.seconds)
    held = _held_share(layout, scheme, costs, every)
    later_fwd, later_bwd = _later(costs, phases, eff, held)
    if accum > 1:
        mine = [(c, t) for c, t, k in zip(found, times, per_step) if k == accum]
        found_later, times_later = [c for c, _ in mine], [t for _, t in mine]
        exposed += (accum - 1) * _exposed(layout, found_later, times_later, later_fwd, later_bwd)
    forward_s = fwd.seconds + (accum - 1) * later_fwd
    backward_s = bwd.seconds + (accum - 1) * later_bwd
    step = forward_s + backward_s + exposed + optimizer_s
    model = _model_flops(costs)
    tokens = costs.tokens * accum
    # the same sums as the phases' seconds, bound by bound
    weighted = [(fwd, 1.0, 1.0), (bwd, 1.0, 1.0), (opt, 1.0, _stepped_share(layout, scheme, costs))]
    if accum > 1:
        later = [phases[LATER[0]], phases[LATER[1]]]
        weighted += [(p, accum - 1.0, 1.0) for p in later]
        weighted.append((phases[ACCUMULATE], accum - 1.0, held))
    comm_s = sum(k * t for k, t in zip(per_step, times))
    return StepEstimate(
        gpu=gpu.name,
        scheme=scheme.timing_key,
        world_size=n,
        tokens=tokens,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
        comm_s=comm_s,
        exposed_comm_s=exposed,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=model / (gpu.matrix_peak(_main_dtype(costs)) * step),
        sent_bytes=sum(k * c.sent for k, c in zip(per_step, found)),
        model_flops=model,
        compute_bound_s=_by_bound(weighted),
        decided_by="communication" if comm_s > forward_s + backward_s else "compute",
    )


def _by_bound(weighted) -> dict[str, float]:
    """The seconds each bound decides over ``(phase, times, share)``: a phase's
    kernels run ``times`` times, their part above the floor scaled by ``share`` (the
    optimizer's, on this rank's part of the parameters)."""
    out = dict.fromkeys(BOUNDS, 0.0)
    for phase, times, share in weighted:
        for bound, seconds in phase.bound_s.items():
            out[bound] += times * (seconds if bound == "floor" else seconds * share)
    return out


def _later(costs: StepCosts, phases, eff: Efficiency, share: float) -> tuple[float, float]:
    """A later micro-batch's forward and backward seconds (none with one micro-batch);
    its adds into the gradients held (``ACCUMULATE``), above the launch floor, scaled
    by ``share``, the part of them this rank holds."""
    if costs.grad_accum == 1:
        return 0.0, 0.0
    adds = phases[ACCUMULATE]
    floor = adds.kernels * eff.kernel_floor_s
    return phases[LATER[0]].seconds, phases[LATER[1]].seconds + (
        adds.seconds - floor
    ) * share + floor


def _held_share(layout: Layout, scheme: Scheme, costs: StepCosts, every: bool) -> float:
    """The part of the gradients a rank holds between micro-batches: its shards' where
    the scheme shards gradients and reduces every micro-batch, else all of them
    (DDP; FSDP2 with gradient sync off holds them unsharded)."""
    if scheme.holds.grads == WHOLE or not every:
        return 1.0
    return _stepped_share(layout, scheme, costs)


def _model_flops(costs: StepCosts) -> int:
    """The step's useful work: every micro-batch's forward and backward, the optimizer's."""
    per_micro = costs.phase("forward").model_flops + costs.phase("backward").model_flops
    return costs.model_flops + (costs.grad_accum - 1) * per_micro


def phase_times(costs: StepCosts, gpu: GpuSpec, eff: Efficiency) -> dict[str, PhaseTime]:
    """Each phase's kernels on the roofline (a later micro-batch's too, where counted)."""
    later = (*LATER, ACCUMULATE) if costs.grad_accum > 1 else ()
    phases = ("forward", "backward", "optimizer", *later)
    return {p: phase_time(costs.ops, p, gpu, eff) for p in phases}


def _main_dtype(costs: StepCosts) -> str:
    by_dtype: dict[str, int] = {}
    for p in costs.phases:
        for dtype, flops in p.matrix_flops.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + flops
    return max(by_dtype, key=by_dtype.get) if by_dtype else "float32"


def _stepped_share(layout: Layout, scheme: Scheme, costs: StepCosts) -> float:
    """The part of the parameters one rank's optimizer steps."""
    if scheme.holds.optimizer == WHOLE or layout.world_size == 1 or not costs.params:
        return 1.0
    shards = sum(b.shard_numel for b in layout.buffers if b.requires_grad)
    kept = sum(t.numel for t in layout.kept if t.is_param and t.requires_grad and t.floating)
    return min(1.0, (shards + kept) / costs.params)


def unit_shares(layout: Layout) -> dict[str, float]:
    """Each unit's part of the parameter elements (the root's includes the kept ones)."""
    elems = dict.fromkeys(unit_order(layout), 0)
    for b in layout.buffers:
        elems[b.unit] += b.numel
    elems[ROOT] += sum(t.numel for t in layout.kept if t.is_param)
    total = sum(elems.values())
    if not total:
        return {u: 1.0 / len(elems) for u in elems}
    return {u: e / total for u, e in elems.items()}


def _exposed(layout, found, times, forward_s: float, backward_s: float) -> float:
    if not found:
        return 0.0
    order = unit_order(layout)
    shares = unit_shares(layout)
    gather_f, gather_b, reduce_b = ({u: 0.0 for u in order} for _ in range(3))
    for c, t in zip(found, times):
        if c.kind == "all_gather":
            (gather_f if c.phase == "forward" else gather_b)[c.unit] += t
        else:
            reduce_b[c.unit] += t
    fwd = exposed_time(
        [forward_s * shares[u] for u in order], [gather_f[u] for u in order], [0.0] * len(order)
    )
    back = order[::-1]
    bwd = exposed_time(
        [backward_s * shares[u] for u in back],
        [gather_b[u] for u in back],
        [reduce_b[u] for u in back],
    )
    return fwd + bwd


def exposed_time(compute: list[float], before: list[float], after: list[float]) -> float:
    """Communication that compute does not hide, with one unit prefetched: unit ``k``
    needs ``before[k]`` done before it computes (issued during unit ``k - 1``) and
    issues ``after[k]`` when it ends (hidden behind unit ``k + 1``). See the module
    docstring for the formula."""
    m = len(compute)
    if m == 0:
        return 0.0
    exposed = before[0] + after[-1]
    for k in range(m):
        during = (after[k - 1] if k else 0.0) + (before[k + 1] if k + 1 < m else 0.0)
        exposed += max(0.0, during - compute[k])
    return exposed


# -- choosing a configuration ------------------------------------------------------

OBJECTIVES = ("throughput", "gpu-hours", "fewest-gpus")
DEFAULT_OBJECTIVE = "throughput"
SAME_SPEED = 0.01  # tokens/s this close to the fastest (a fraction of it) are a tie


@dataclass(frozen=True, slots=True)
class TimedCell:
    """A candidate configuration: a plan's cell with its step estimate."""

    world_size: int
    micro_batch: int
    checkpointing: str
    fits: bool
    estimate: StepEstimate


@dataclass(frozen=True, slots=True)
class Choice:
    cell: TimedCell
    objective: str
    gpu_hours: float | None  # for ``tokens`` tokens, where given
    wall_hours: float | None


def best_cell(
    cells, objective: str = DEFAULT_OBJECTIVE, tokens: int | None = None
) -> Choice | None:
    """The best of the cells that fit under ``objective``; ``None`` if none fits.

    - ``throughput`` (the default: it needs no token count, and a GPU's speed is
      what both the time and the cost of training follow): the most tokens/s per
      GPU; ties go to fewer GPUs, then to no checkpointing;
    - ``gpu-hours``: the fewest GPU-hours to train on ``tokens`` tokens
      (``tokens / tokens_per_s_per_gpu / 3600``: the same order as throughput, with
      the hours); ties go to the shorter wall time;
    - ``fewest-gpus``: the smallest world size that fits; ties go to throughput.

    Speeds within ``SAME_SPEED`` of the fastest cell's are a tie: the model is not
    finer than that, and a plan of a large model has many world sizes whose speeds
    differ only by the optimizer's shrinking shard (``objective_key``).
    """
    if objective not in OBJECTIVES:
        raise YafsdpError(f"objective {objective!r} is not one of {'|'.join(OBJECTIVES)}")
    if objective == "gpu-hours" and not (tokens and tokens > 0):
        raise YafsdpError("objective gpu-hours needs the number of tokens to train on")
    fitting = [c for c in cells if c.fits]
    if not fitting:
        return None
    fastest = max(c.estimate.tokens_per_s for c in fitting)
    best = min(fitting, key=objective_key(objective, fastest))
    gpu_h = wall_h = None
    if tokens:
        gpu_h = tokens / best.estimate.tokens_per_s / 3600
        wall_h = gpu_h / best.world_size
    return Choice(best, objective, gpu_h, wall_h)


def objective_key(objective: str, fastest: float):
    """The sort key of ``best_cell``'s order under ``objective`` (best first), for
    anything with ``world_size``, ``checkpointing`` and ``estimate`` or ``time`` (a
    ``StepEstimate``); ``fastest``: the most tokens/s per GPU of the cells sorted, whose
    speed every cell within ``SAME_SPEED`` of it counts as having."""

    def speed(c) -> float:
        est = getattr(c, "estimate", None) or c.time
        tps = est.tokens_per_s
        return fastest if tps >= (1 - SAME_SPEED) * fastest else tps

    keys = {
        "throughput": lambda c: (-speed(c), c.world_size, c.checkpointing != "none"),
        "gpu-hours": lambda c: (-speed(c), -c.world_size),
        "fewest-gpus": lambda c: (c.world_size, -speed(c)),
    }
    return keys[objective]
