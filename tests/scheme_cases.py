"""One model and one reference step for the schemes' tests (``tests/schemes``), and the
figures the memory model gave for them before schemes were objects: each scheme's
``MemoryBreakdown`` parts and its peak at forward, backward and optimizer, at world
size 4, per ``reshard_after_forward``. A scheme object must keep giving them."""

from __future__ import annotations

from yafsdp_cli import LayoutOptions, ModelSpec, TensorRecord, plan
from yafsdp_cli.memory import MemoryConfig
from yafsdp_cli.memory.step_schemes import SchemeSettings, StepAt, scheme_memory

PHASES = ("forward", "backward", "optimizer")
STEP = StepAt(activations=100, temporaries=-10, unheld=30, grads=5000)
WS = 4

# (params, grads, optimizer, master, buffers, gather, reduce), (forward, backward, optimizer)
TODAY = {
    ("flat", True): ((1311488, 1311488, 5245952, 2622976, 0, 4194304, 4194304),
                     (18880602, 18880602, 18880602)),
    ("fsdp2", True): ((2622976, 2622976, 5245952, 0, 0, 4196352, 2097152),
                      (16785498, 16785498, 16785498)),
    ("fsdp2", False): ((2622976, 2622976, 5245952, 0, 0, 5245952, 2097152),
                       (13115000, 15212152, 10492024)),
    ("zero1", True): ((5245952, 5245952, 5245952, 2622976, 0, 0, 1000000000),
                      (13115000, 1013120000, 13116235)),
    ("zero2", True): ((5245952, 1311488, 5245952, 2622976, 0, 0, 1000000000),
                      (13115000, 1014426488, 13116235)),
    ("zero3", True): ((1313792, 1311488, 5245952, 2622976, 0, 5245952, 1000000000),
                      (1015740280, 1015740280, 1010494328)),
    ("ddp", True): ((5245952, 5245952, 20983808, 10491904, 0, 0, 5245952),
                    (47213658, 47213658, 47213658)),
}  # fmt: skip
# at world size 1 every scheme holds DDP's bytes, flat and zero alike, and peaks there
AT_ONE = ((5245952, 5245952, 20983808, 10491904, 0, 0, 0), (41967706,) * 3)
AT_ONE_FSDP2 = ((10491904, 10491904, 20983808, 0, 0, 0, 0), (41967706,) * 3)


def spec(blocks: int = 3, hidden: int = 512) -> ModelSpec:
    """Blocks of two (hidden, hidden) weights and a small norm, a root embedding."""
    tensors = [TensorRecord("embed.weight", (4 * hidden, hidden), "bfloat16")]
    for i in range(blocks):
        for name in ("a", "b"):
            tensors.append(TensorRecord(f"layers.{i}.{name}.weight", (hidden, hidden), "bfloat16"))
        tensors.append(TensorRecord(f"layers.{i}.norm.weight", (hidden,), "bfloat16"))
    units = tuple(f"layers.{i}" for i in range(blocks))
    modules = ("embed", "layers", *units)
    return ModelSpec(tuple(tensors), has_architecture=False, units=units, module_names=modules)


def figures(scheme, ws: int = WS, reshard: bool = True) -> tuple[tuple, tuple]:
    """``scheme``'s parts and per-phase peaks, in ``TODAY``'s shape."""
    settings = SchemeSettings(reshard_after_forward=reshard)
    layout = plan(spec(), LayoutOptions(world_size=ws, units=("layers.*",)))
    m = scheme_memory(scheme, layout, MemoryConfig(round_bytes=1), settings)
    parts = (m.params, m.grads, m.optimizer, m.master, m.buffers, m.gather, m.reduce)
    return parts, tuple(scheme.phase_peak(p, m, STEP, ws, settings) for p in PHASES)
