"""The GPUs yafsdp knows by name: one row each, the one list of them.

``timing.gpu_specs`` makes each row a ``GpuSpec`` (its figures in FLOP/s and bytes/s),
``--gpu``'s help lists the names, and ``calibrate`` finds a CUDA device's row by the
device name it matches. Nothing here imports torch or the step-time model, so the
command line can name the GPUs without loading either.
"""

from __future__ import annotations

MIB, GIB = 1 << 20, 1 << 30

# name, memory (bytes), bf16, fp8, fp32 (TFLOP/s dense), HBM, link one way (GB/s), GPUs
# per node, what torch.cuda.get_device_name holds for it, and the datasheet
ROWS = (
    ("A100-40GB", 40 * GIB, 312, 0, 19.5, 1555, 300, 8, "A100-SXM4-40GB",
     "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB; NVLink 3, 600 GB/s)"),
    ("A100-80GB", 80 * GIB, 312, 0, 19.5, 2039, 300, 8, "A100",
     "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB; NVLink 3, 600 GB/s)"),
    ("H100-SXM", 81559 * MIB, 989.4, 1978.9, 66.9, 3350, 450, 8, "H100",
     "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM; NVLink 4, 900 GB/s)"),
    ("H100-PCIe", 81559 * MIB, 756, 1513, 51, 2000, 64, 8, "H100 PCIe",
     "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe; PCIe Gen5, 128 GB/s)"),
    ("H200", 143771 * MIB, 989.4, 1978.9, 66.9, 4800, 450, 8, "H200",
     "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM; NVLink 4, 900 GB/s)"),
    ("B200", 183359 * MIB, 2250, 4500, 75, 8000, 900, 8, "B200",
     "NVIDIA DGX B200 datasheet (per GPU, dense; NVLink 5, 1.8 TB/s)"),
    ("L40S", 46068 * MIB, 362.05, 733, 91.6, 864, 32, 8, "L40S",
     "NVIDIA L40S datasheet (48GB GDDR6 with ECC; PCIe Gen4 x16, 64 GB/s)"),
    ("MI300X", 192 * GIB, 1307.4, 2614.9, 163.4, 5300, 448, 8, "MI300X",
     "AMD Instinct MI300X datasheet (7 Infinity Fabric links, 64 GB/s each way)"),
)  # fmt: skip

NAMES = tuple(row[0] for row in ROWS)
# (device-name text, row name), the most specific text first: "H100 PCIe" before "H100"
DEVICE_NAMES = tuple(sorted(((row[8], row[0]) for row in ROWS), key=lambda m: -len(m[0])))
