"""The pieces of one training step that ``verify`` and ``profile`` share.

- ``make_batch``: seeded inputs from the model kind. A Hugging Face model
  (``main_input_name`` and a config) gets ``input_ids`` from its vocabulary, plus
  ``decoder_input_ids`` when it is an encoder-decoder (T5, BART), or
  ``pixel_values`` for vision models, and ``use_cache=False`` where its forward
  takes it. Anything else goes through ``inputs.make_input`` (token ids for an
  ``Embedding`` first layer, images for convolutions, features for ``Linear``).
- ``output_tensor``: the tensor a loss is taken on: ``logits``, else
  ``last_hidden_state`` of a ``ModelOutput``, else the first tensor found.
- ``step_loss``: ``(output * R).sum()`` in float32 for a seeded random ``R``, so every
  output element (and so every parameter) gets a gradient.
- ``make_optimizer``: AdamW/Adam/SGD-with-momentum (lr 1e-3) with the chosen
  implementation: ``for-loop`` (``foreach=False``) is what verify uses on both
  sides, because its kernels give every element the same result wherever it sits
  in a tensor (torch 2.13 CPU: true of Adam/AdamW in every dtype; the fused
  kernels differ in the last bit near tensor ends even in float32);
  ``auto`` is torch's own default, what profile uses.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..errors import YafsdpError
from .choices import OPTIMIZER_IMPLS, OPTIMIZERS, check_optimizer  # noqa: F401 - the step's API
from .inputs import BatchChoice, BatchDefaults, make_input, projection_loss

OptimizerImpl = Literal["auto", "for-loop", "foreach", "fused"]
LR = 1e-3


@dataclass(frozen=True, slots=True)
class Batch:
    """Positional and keyword arguments of one forward call."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        items = [*self.args, *self.kwargs.values()]
        return [t for t in items if isinstance(t, torch.Tensor)]

    def describe(self) -> str:
        """``"input_ids (2, 16) int64, ..."``."""
        items = [*(("input", a) for a in self.args), *self.kwargs.items()]
        return ", ".join(
            f"{k} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in items
            if isinstance(v, torch.Tensor)
        )

    def map(self, fn) -> Batch:
        """The same batch with ``fn`` applied to every tensor (e.g. to fake it)."""

        def one(v):
            return fn(v) if isinstance(v, torch.Tensor) else v

        return Batch(tuple(one(a) for a in self.args), {k: one(v) for k, v in self.kwargs.items()})


def make_batch(
    module: nn.Module, step: BatchChoice | None = None, *, seed: int | None = None
) -> Batch:
    """Seeded inputs for ``module`` (see the module docstring), as the step options
    ``step`` say (None: the defaults); ``seed`` in place of the step's (verify seeds
    each micro-batch of each rank on its own)."""
    step = BatchDefaults() if step is None else step
    seed = step.seed if seed is None else seed
    main = getattr(module, "main_input_name", None)
    config = getattr(module, "config", None)
    if isinstance(main, str) and hasattr(config, "to_dict"):
        return _hf_batch(module, main, config, step, seed)
    return Batch((make_input(module, step, seed=seed),))


def _hf_batch(module, main, config, step: BatchChoice, seed: int) -> Batch:
    batch, seq_len, input_shape = step.batch, step.seq_len, step.input_shape
    g = torch.Generator().manual_seed(seed)
    device = _device_of(module)
    kwargs: dict[str, Any] = {}
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", None)
        if not vocab:
            raise YafsdpError(f"{type(module).__name__}: its config has no vocab_size")
        shape = tuple(input_shape) if input_shape else (batch, seq_len)
        kwargs["input_ids"] = torch.randint(0, vocab, shape, generator=g).to(device)
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = torch.randint(0, vocab, shape, generator=g).to(device)
    elif main == "pixel_values" and not input_shape and hasattr(config, "image_size"):
        size = config.image_size
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        shape = (batch, getattr(config, "num_channels", 3), *size)
        kwargs[main] = torch.randn(shape, generator=g).to(device=device, dtype=_dtype_of(module))
    elif input_shape:
        kwargs[main] = torch.randn(tuple(input_shape), generator=g).to(
            device=device, dtype=_dtype_of(module)
        )
    else:
        raise YafsdpError(
            f"{type(module).__name__} takes {main!r}, which yafsdp cannot make up; "
            "give --input-shape"
        )
    if accepts(module, "use_cache"):
        kwargs["use_cache"] = False  # no key/value cache: it is not part of training
    return Batch((), kwargs)


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def accepts(module: nn.Module, name: str, *, any_keyword: bool = False) -> bool:
    """Whether ``module``'s forward takes ``name`` (``any_keyword``: or ``**kwargs``)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any_keyword and any(p.kind is p.VAR_KEYWORD for p in params.values())


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor of a model's output that the loss is taken on."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):  # ModelOutput is an OrderedDict
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        values = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise YafsdpError(
        f"the model returned {type(out).__name__} with no floating-point tensor to take a loss on"
    )


def step_loss(out: Any, seed: int) -> torch.Tensor:
    """``(output * R).sum()`` in float32 for a seeded random ``R`` of the output's shape."""
    return projection_loss(output_tensor(out), seed)


def run_forward(model: nn.Module, batch: Batch) -> Any:
    """``model(batch)``; a failure of the model's own code is a YafsdpError that says
    what it was given."""
    try:
        return model(*batch.args, **batch.kwargs)
    except YafsdpError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise YafsdpError(
            f"the model's forward failed on {batch.describe()} ({type(exc).__name__}: "
            f"{first}); give --input-shape, or check --model"
        ) from exc


def rng_fingerprint() -> bytes:
    """The state of every torch generator (CPU, and each CUDA device that started one)."""
    parts = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts += torch.cuda.get_rng_state_all()
    return b"".join(bytes(p.numpy().tobytes()) for p in parts)


def forward_backward(model: nn.Module, inputs: Batch, seed: int) -> torch.Tensor:
    """One micro-batch: forward (dropout seeded by ``seed``: ``torch.manual_seed`` sets
    the CPU and every CUDA generator), loss, backward; the output."""
    torch.manual_seed(seed)
    out = run_forward(model, inputs)
    step_loss(out, seed).backward()
    return output_tensor(out).detach()


def make_optimizer(kind: str, params, impl: str = "for-loop") -> torch.optim.Optimizer | None:
    """The optimizer ``kind`` over ``params``; SGD has momentum (one state per element)."""
    check_optimizer(kind, impl)
    params = [p for p in params if p.requires_grad]
    if kind == "none" or not params:
        return None
    flags = {
        "auto": {},  # torch's own choice: for-loop on CPU, foreach on CUDA
        "for-loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    kw = flags[impl]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR, **kw)
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01, **kw)


def optimizer_tensors(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps between steps (its states, ``step`` counters too)."""
    if opt is None:
        return []
    return [
        v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
