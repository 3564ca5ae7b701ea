"""Memory a CUDA process holds beyond its tensors: the context and cuBLAS workspaces.

Run once per configuration on a machine with a GPU; each run prints one JSON line:

    python3 benchmarks/outside_cuda.py default
    CUBLAS_WORKSPACE_CONFIG=:4096:2 python3 benchmarks/outside_cuda.py cublas4096x2

``ctx_*``: bytes the device has in use that the caching allocator has not reserved
(``mem_get_info`` less ``memory_reserved``), after the first tensor, after the first
matmuls and after two training steps of a transformer layer (lazy module loading
loads kernels as they are first called). ``ws_*``: bytes the first matmul (cuBLAS),
the first ``linear`` with a bias (cuBLASLt) and the first backward (autograd's own
thread, so its own cuBLAS handle) allocate beyond their outputs; ``ws_held``: what
clearing the workspaces frees after the steps. The figures are what
``yafsdp_cli.memory.outside_allocator`` uses; ``gpu/outside-h200.log`` holds a run.
"""

import json
import sys

import torch


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main(label: str) -> dict:
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    r = {"env": label, "torch": torch.__version__, "cuda": torch.version.cuda}
    r["cap"] = torch.cuda.get_device_capability()
    r["ctx_init"] = used() - torch.cuda.memory_reserved()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    s = allocated()
    b = a @ a
    r["ws_mm"] = allocated() - s - b.nbytes
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    s = allocated()
    c = torch.nn.functional.linear(a, a, bias)
    r["ws_lt"] = allocated() - s - c.nbytes
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    s = allocated()
    (a.float() @ w).sum().backward()
    r["ws_bw"] = allocated() - s - w.grad.nbytes
    r["ctx_mm"] = used() - torch.cuda.memory_reserved()
    layer = torch.nn.TransformerEncoderLayer(
        1024, 8, batch_first=True, device="cuda", dtype=torch.bfloat16
    )
    opt = torch.optim.AdamW(layer.parameters())
    for _ in range(2):
        x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
        layer(x).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    r["ctx_step"] = used() - torch.cuda.memory_reserved()
    s = allocated()
    torch._C._cuda_clearCublasWorkspaces()
    r["ws_held"] = s - allocated()
    return r


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "default")))
