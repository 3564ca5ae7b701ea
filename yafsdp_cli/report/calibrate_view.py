"""``yafsdp calibrate`` output: what was measured and the profile it wrote, in lines."""

from __future__ import annotations

from ..timing.calibrate import Measured


def summary_lines(m: Measured, path: str) -> list[str]:
    eff, gpu = m.profile.efficiency, m.profile.gpu
    tflops = sum(2 * r.m * r.k * r.n * r.count for r in m.matmuls) / sum(
        r.seconds * r.count for r in m.matmuls
    )
    step = m.profile.calibration["step"]
    return [
        f"{m.profile.calibration['device']} against {gpu.source.split(';')[0]}",
        f"matrix products at the model's {len(m.matmuls)} training shapes: "
        f"{tflops / 1e12:.1f} TFLOP/s, efficiency {eff.matrix:.3f}",
        f"HBM copy: {m.hbm_bytes_per_s / 1e9:.0f} GB/s, efficiency {eff.memory:.3f}",
        f"tiny op: {m.tiny_op_s * 1e6:.1f} us; kernel floor fitted to the step: "
        f"{eff.kernel_floor_s * 1e6:.2f} us over {m.kernels} kernels",
        f"training step ({step['batch']} x {step['seq_len']} tokens, {step['param_dtype']}, "
        f"{step['optimizer']}, checkpointing {step['checkpointing']}): measured "
        f"{m.step_s * 1e3:.1f} ms, predicted {m.datasheet_s * 1e3:.1f} ms on the datasheet, "
        f"{m.predicted_s * 1e3:.1f} ms calibrated",
        f"wrote {path}: yafsdp plan ... --gpu-profile {path}",
    ]
