"""What decides a step: each phase's time split by the bound that decides each of its
kernels (products, attention, vector math, memory, and the launch floors), the step's
compute split the same way, and whether the collectives or the compute decide it."""

from __future__ import annotations

import pytest

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.options import LayoutOptions, StepOptions
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import Cluster, count_step, estimate_step, gpu_spec
from yafsdp_cli.timing.roofline import BOUNDS, efficiency_for, op_time
from yafsdp_cli.timing.step_estimate import phase_times

tf = pytest.importorskip("transformers")
GPU = gpu_spec("h100-sxm")
EFF = efficiency_for(GPU)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama wide enough that its products are bound by their FLOPs on an H100."""
    config = tf.LlamaConfig(
        vocab_size=96, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("llama")
    config.save_pretrained(path)
    return load_source(str(path))


def _costs(llama, **step):
    opts = ProfileOptions(step=StepOptions(target="cuda", seq_len=512, batch=2, **step))
    return count_step(llama, opts)


def test_a_phase_is_split_by_the_bound_of_each_kernel(llama):
    costs = _costs(llama, param_dtype="bf16")
    for name, phase in phase_times(costs, GPU, EFF).items():
        assert set(phase.bound_s) == set(BOUNDS)
        assert sum(phase.bound_s.values()) == pytest.approx(phase.seconds, rel=1e-12)
        assert phase.bound_s["floor"] == pytest.approx(phase.kernels * EFF.kernel_floor_s)
        ops = [o for o in costs.ops if o.phase == name]
        # a flash kernel decided by its products counts as attention, not as matrix
        timed = [(o, *op_time(o, GPU, EFF)) for o in ops]
        attention = sum(
            t - EFF.kernel_floor_s
            for o, t, bound in timed
            if bound == "matrix" and "attention" in o.name
        )
        assert phase.bound_s["attention"] == pytest.approx(attention, rel=1e-12)
        if name != "optimizer":
            assert phase.bound_s["attention"] > 0 and phase.bound_s["matrix"] > 0
    # the optimizer step is memory: no products, every kernel bound by its bytes
    optimizer = phase_times(costs, GPU, EFF)["optimizer"].bound_s
    assert optimizer["matrix"] == optimizer["attention"] == 0 < optimizer["memory"]


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("world", [1, 8])
def test_the_step_compute_is_split_the_same_way(llama, accum, world):
    costs = _costs(llama, grad_accum=accum)
    est = estimate_step(costs, plan(llama.spec, LayoutOptions(world_size=world)), GPU)
    split = est.compute_bound_s
    assert sum(split.values()) == pytest.approx(est.compute_s, rel=1e-12)
    assert est.compute_s == pytest.approx(est.forward_s + est.backward_s + est.optimizer_s)
    assert est.step_s == pytest.approx(est.compute_s + est.exposed_comm_s)
    phases = phase_times(costs, GPU, EFF)
    matrix = phases["forward"].bound_s["matrix"] + phases["backward"].bound_s["matrix"]
    if accum > 1:
        matrix += (accum - 1) * (
            phases["later_forward"].bound_s["matrix"] + phases["later_backward"].bound_s["matrix"]
        )
    assert split["matrix"] == pytest.approx(matrix, rel=1e-12)  # no products in the optimizer


def test_communication_decides_a_step_whose_collectives_outlast_its_compute(llama):
    costs = _costs(llama)
    one = estimate_step(costs, plan(llama.spec, LayoutOptions(world_size=1)), GPU)
    assert one.comm_s == 0 and one.decided_by == "compute"
    # 64 GPUs, 8 nodes, over a slow network: the all-gathers take longer than compute
    layout = plan(llama.spec, LayoutOptions(world_size=64))
    slow = estimate_step(costs, layout, GPU, cluster=Cluster(inter_node_bytes_per_s=1e8))
    assert slow.comm_s > slow.forward_s + slow.backward_s
    assert slow.decided_by == "communication" and slow.exposed_comm_s > 0
    fast = estimate_step(costs, layout, GPU, cluster=Cluster(inter_node_bytes_per_s=1e15))
    assert fast.comm_s < fast.forward_s + fast.backward_s and fast.decided_by == "compute"
