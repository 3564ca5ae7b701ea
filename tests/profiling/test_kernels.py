"""The fake step's kernel substitutions: the real-input rule, ``_grouped_mm`` as the CPU
kernel allocates it, and ``--target cuda``'s attention as the CUDA kernels save it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import options
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.profiling.fake import REAL_LIMIT, FakeStep, entered, make_fake_mode
from yafsdp_cli.profiling.kernels import CudaAttention, cuda_kernel
from yafsdp_cli.sources import load_source

runner = CliRunner()
grouped = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


class Layouts(TorchDispatchMode):
    """Every op's name and its outputs' (shape, stride, dtype, storage bytes)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # prim.device: FakeTensor's own queries
            return out
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.seen.append(
            (
                str(func),
                [
                    (tuple(o.shape), o.stride(), o.dtype, o.untyped_storage().nbytes())
                    for o in outs
                    if isinstance(o, torch.Tensor)
                ],
            )
        )
        return out


def grouped_step(x, w, offs, transposed: bool):
    """Forward and backward of one grouped matmul, as transformers' experts run it."""
    y = torch.nn.functional.grouped_mm(x, w.transpose(-2, -1) if transposed else w, offs=offs)
    y.backward(torch.ones_like(y))


@grouped
@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 5),
    k=st.sampled_from([8, 16, 24]),
    n=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    transposed=st.booleans(),
)
def test_fake_grouped_mm_allocates_what_the_cpu_kernel_does(
    tokens, experts, k, n, dtype, transposed
):
    """Output and gradient layouts of the real CPU kernel and of the fake step, op by op
    through forward and backward (the kernel takes 16-byte aligned rows only)."""
    n = -(-n * dtype.itemsize // 16) * 16 // dtype.itemsize
    cuts = [tokens * (e + 1) // experts for e in range(experts)]  # group ends
    offs = torch.tensor(cuts, dtype=torch.int32)
    shape_w = (experts, n, k) if transposed else (experts, k, n)
    x = torch.randn(tokens, k, dtype=dtype, requires_grad=True)
    w = torch.randn(shape_w, dtype=dtype, requires_grad=True)
    real = Layouts()
    with real:
        grouped_step(x, w, offs, transposed)
    mode = make_fake_mode()
    with mode:
        fx = torch.empty(tokens, k, dtype=dtype, requires_grad=True)
        fw = torch.empty(shape_w, dtype=dtype, requires_grad=True)
    fake = Layouts()
    with entered(mode, FakeStep(), fake):
        grouped_step(fx, fw, offs, transposed)
    assert fake.seen == real.seen


@grouped
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_grouped_mm_pads_rows_as_the_kernel_does(dtype):
    """A transposed weight with 5 output columns: each output row starts on a 16-byte
    boundary (torch's meta kernel packs them on a CPU build)."""
    offs = torch.tensor([3, 10], dtype=torch.int32)
    x, w = torch.randn(10, 8, dtype=dtype), torch.randn(2, 5, 8, dtype=dtype)
    real = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    mode = make_fake_mode()
    with mode:
        fx, fw = torch.empty(10, 8, dtype=dtype), torch.empty(2, 5, 8, dtype=dtype)
    with entered(mode, FakeStep()):
        fake = torch._grouped_mm(fx, fw.transpose(-2, -1), offs=offs)
    align = 16 // dtype.itemsize  # elements
    assert real.stride() == fake.stride() == (-(-5 // align) * align, 1)
    assert real.untyped_storage().nbytes() == fake.untyped_storage().nbytes()


def test_ops_on_real_tensors_run_for_real_and_weights_stay_fake():
    mode = make_fake_mode()
    with mode:
        weight = torch.empty(10, 4)
    ids = torch.tensor([[1, 2, 3]])
    with entered(mode, FakeStep()):
        positions = torch.arange(ids.shape[1])  # an index factory: real
        shifted = positions + 1  # real inputs only: real
        table = torch.ones(3, 3)  # a floating factory: fake
        mask = torch.ones(3, 3, dtype=torch.bool).tril()  # an index factory: real
        out = F.embedding(ids, weight)  # a fake weight: fake
        where = torch.nonzero(mask)  # a data-dependent shape: real
        big = torch.ones(REAL_LIMIT + 1, dtype=torch.bool)  # over the limit: fake
        bigger = ids.expand(REAL_LIMIT + 1, 3) + 1  # all-real inputs, over the limit: fake
        first = int(ids[0, 0])  # a value: real
        counted = torch.arange(3)
        counted += torch.full_like(counted, 10)  # a write into a real tensor: once
        counted.add_(1)
        overwritten = torch.arange(3)
        overwritten.add_(F.embedding(torch.tensor([1]), weight)[0, :3].long())  # fake values
        after = overwritten + 1  # no longer known: fake
    assert not isinstance(positions, FakeTensor) and shifted.tolist() == [1, 2, 3]
    assert where.shape == (6, 2) and first == 1 and counted.tolist() == [11, 12, 13]
    assert isinstance(big, FakeTensor) and isinstance(bigger, FakeTensor)
    assert isinstance(after, FakeTensor) and after.shape == (3,)
    assert not isinstance(mask, FakeTensor) and bool(mask[2, 0]) and not bool(mask[0, 2])
    assert isinstance(table, FakeTensor) and isinstance(out, FakeTensor)
    assert out.shape == (1, 3, 4)


def test_a_real_index_past_the_table_fails_as_the_kernel_does():
    mode = make_fake_mode()
    with mode:
        weight = torch.empty(8, 4)
    with entered(mode, FakeStep()), pytest.raises(IndexError, match="index out of range"):
        F.embedding(torch.arange(9), weight)
    with pytest.raises(IndexError, match="index out of range"):
        F.embedding(torch.arange(9), torch.zeros(8, 4))  # the real kernel


@pytest.mark.parametrize(
    ("dtype", "dims", "mask", "kernel"),
    [
        (torch.bfloat16, (8, 8, 8), False, "flash"),
        (torch.float16, (256, 256, 256), False, "flash"),
        (torch.bfloat16, (264, 264, 264), False, "efficient"),  # flash stops at 256
        (torch.bfloat16, (8, 8, 8), True, "efficient"),  # flash takes no mask
        (torch.float32, (8, 8, 8), False, "efficient"),  # flash takes no float32
        (torch.float32, (6, 6, 6), False, "math"),  # float32 needs head dims % 4
        (torch.bfloat16, (12, 12, 12), True, "math"),  # half needs % 8
        (torch.float64, (8, 8, 8), False, "math"),
    ],
)
def test_cuda_kernel_choice(dtype, dims, mask, kernel):
    q, k, v = (torch.empty(1, 2, 4, d, dtype=dtype) for d in dims)
    m = torch.ones(4, 4, dtype=torch.bool) if mask else None
    assert cuda_kernel(q, k, v, m, is_causal=not mask) == kernel


def saved_by_attention(dtype, heads=4, kv_heads=4, seq=50, dim=16, **kw):
    """(shape, dtype) of what autograd saves for one ``--target cuda`` attention call,
    and the kernels used."""
    mode = make_fake_mode()
    with mode:
        q = torch.empty(2, seq, heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.empty(2, seq, kv_heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
        v = torch.empty(2, seq, kv_heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()
    saved = []
    attention = CudaAttention()
    with (
        entered(mode, FakeStep(), attention),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
    ):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        out.sum().backward()
    inputs = {id(t) for t in (q, k, v)}
    return [(tuple(t.shape), t.dtype) for t in saved if id(t) not in inputs], attention.used, out


def test_cuda_flash_saves_output_logsumexp_and_rng_state():
    saved, used, out = saved_by_attention(
        torch.bfloat16, kv_heads=2, is_causal=True, dropout_p=0.1, enable_gqa=True
    )
    assert dict(used) == {"flash": 1}
    assert out.shape == (2, 4, 50, 16)
    assert saved == [
        ((2, 4, 50), torch.float32),  # log-sum-exp: (batch, heads, seq)
        ((2, 4, 50, 16), torch.bfloat16),  # the output
        ((2,), torch.uint64),  # philox state
        ((), torch.uint64),
    ]


def test_cuda_efficient_pads_its_logsumexp_to_32():
    saved, used, _ = saved_by_attention(torch.float32, is_causal=True)
    assert dict(used) == {"efficient": 1}
    assert saved == [
        ((2, 4, 64), torch.float32),  # log-sum-exp, 50 queries rounded up to 64
        ((2, 4, 50, 16), torch.float32),  # the output
        ((), torch.int64),  # seed and offset
        ((), torch.int64),
    ]


def test_cuda_target_rounds_and_names_its_kernels():
    loaded = lambda: load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")  # noqa: E731
    cpu = profile_model(loaded(), options(ProfileOptions, fake=True, batch=1, seq_len=64))
    cuda = profile_model(
        loaded(), options(ProfileOptions, fake=True, batch=1, seq_len=64, target="cuda")
    )
    assert (cuda.target, cuda.round_bytes, cuda.optimizer_impl) == ("cuda", 512, "foreach")
    assert cuda.kernels == {"efficient": 4}  # 2 blocks, original and converted
    assert "--target cuda without a GPU" in " ".join(cuda.notes)
    for step in (cuda.original, cuda.converted_step):
        assert all(v % 512 == 0 for v in step.phase_peaks.values())
    assert cpu.target == "cpu" and cpu.kernels == {}
    # the sample GPT has no attention dropout: flash on the CPU, efficient on CUDA,
    # both saving the output and a log-sum-exp: the same within the rounding
    a, b = cpu.original.phase_peaks["forward"], cuda.original.phase_peaks["forward"]
    assert a <= b <= a + 512 * 200


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_cuda_target_recomputes_checkpointed_units_with_cuda_kernels(mode):
    """A checkpointed unit recomputes its forward inside backward; the recompute must
    take CUDA's attention too (torch calls a function mode with itself off the stack
    while it handles ``loss.backward()``, so it is called past that), else the
    non-reentrant checkpoint sees other tensors saved and fails, and the reentrant
    one silently recomputes the CPU's attention."""
    loaded = lambda: load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")  # noqa: E731
    plain = profile_model(
        loaded(), options(ProfileOptions, fake=True, batch=1, seq_len=64, target="cuda")
    )
    ckpt = profile_model(
        loaded(),
        options(ProfileOptions, fake=True, batch=1, seq_len=64, target="cuda", checkpointing=mode),
    )
    assert plain.kernels == {"efficient": 4}
    assert ckpt.kernels == {"efficient": 8}  # each block's attention again in backward
    assert ckpt.original.phase_peaks["forward"] < plain.original.phase_peaks["forward"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "tpu", "--fake"], "--target 'tpu' is not cpu or cuda"),
        (["--checkpointing", "some"], "is not one of none|reentrant|non-reentrant"),
        # the bound in our words (``numbers``), whatever Typer's version
        (["--modules", "-1"], r"--modules.*must be 0 or more, got -1"),
    ],
)
def test_profile_new_options_bad_input(argv, message):
    result = runner.invoke(app, ["profile", "--model", "sample_models.models:gpt", *argv])
    assert result.exit_code == 2, result.output
    assert re.search(message, " ".join(result.output.split())), result.output
    assert "Traceback" not in result.output
