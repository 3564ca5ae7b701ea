"""The loss a step is taken with (``--loss``), and what it holds.

Where a large-vocabulary model peaks is often the loss: its logits are tokens x
vocabulary elements, and what the loss keeps of them for the backward decides the
peak. So the step takes the loss people train with, and each choice runs its own code:

- ``model``: the model's own loss, as its forward computes it from ``labels=``
  (transformers' causal and masked LMs: the labels are the input ids, shifted inside
  the model; encoder-decoders: the decoder's input ids). The default wherever the
  model computes one (``computes_loss``).
- ``ce``: plain cross-entropy on the output's last dimension, upcast to float32,
  against seeded random targets (``F.cross_entropy``, mean over the tokens).
- ``fused-ce``: a fused cross-entropy kernel on the whole logits (flash-attn's
  ``CrossEntropyLoss``, llm-foundry's default ``fused_crossentropy``; Liger's
  cross-entropy): the logits are held whole in their own dtype until the backward,
  which writes their gradient into a tensor of the same size; the forward keeps only
  a log-sum-exp per token. The kernel's work runs here in at most ``FUSED_CHUNKS``
  chunks of tokens, so it allocates one chunk's float32 logits beyond the kernel's
  outputs at a time (a 64th of the logits, and less where they are few).
- ``chunked-ce[:N]``: the cross-entropy of the output head's logits, ``N`` chunks
  of tokens at a time (8 unless given), so the whole logits are never held: the
  head's forward is replaced by one autograd function (``_ChunkedLinearCE``) that,
  chunk by chunk, makes the chunk's logits, upcasts them, takes their log-sum-exp and
  frees them; the backward makes each chunk's logits again and writes its gradients
  into the hidden states' and the head's. Only the hidden states, the head's weight
  and the targets are kept for the backward. This is what fused and chunked
  cross-entropy kernels (Liger's fused linear cross-entropy, cut cross-entropy) hold.
- ``projection``: ``(output * R).sum()`` in float32 for a seeded random ``R`` of the
  output's shape: every output element, and so every parameter, gets a gradient. The
  default for models without a loss of their own, and the loss ``verify`` checks
  gradients with (a token loss leaves parameters without gradient: the embedding
  rows of tokens not in the batch).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import YafsdpError
from .choices import Loss, parse_loss
from .inputs import projection_loss
from .train_step import accepts, output_tensor

FUSED_CHUNKS = 64
# config fields of models whose forward changes the head's output before returning it
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def computes_loss(module: nn.Module) -> bool:
    """Whether ``module`` computes a token loss of its own from ``labels=``: a
    forward that takes them and an output embedding (a language-model head)."""
    head = _output_embeddings(module)
    return (
        head is not None
        and accepts(module, "labels", any_keyword=True)
        and _label_source(module) is not None
    )


def resolve_loss(module: nn.Module | None, text: str | None) -> Loss:
    """The loss a step of ``module`` takes: ``--loss`` checked against the model, or
    its default (``model`` where it computes one, else ``projection``)."""
    loss = parse_loss(text)
    if loss is None:
        return Loss("model") if module is not None and computes_loss(module) else Loss("projection")
    if module is None or loss.kind in ("ce", "fused-ce", "projection"):
        return loss
    if loss.kind == "model" and not computes_loss(module):
        raise YafsdpError(
            f"--loss model: {type(module).__name__} computes no loss from labels "
            "(no language-model head); use --loss ce or projection"
        )
    if loss.kind == "chunked-ce":
        head = _output_embeddings(module)
        if not isinstance(head, nn.Linear):
            raise YafsdpError(
                f"--loss chunked-ce: {type(module).__name__} has no linear output head "
                "to chunk; use --loss ce or projection"
            )
        config = getattr(module, "config", None)
        changed = [k for k in _LOGIT_CHANGES if getattr(config, k, None) not in (None, 1, 1.0)]
        if changed:
            raise YafsdpError(
                f"--loss chunked-ce: {type(module).__name__} changes its logits after the "
                f"head ({', '.join(changed)}), which a chunked loss would skip; use --loss model"
            )
    return loss


def vocab_size(module: nn.Module | None) -> int | None:
    """The logits per token of ``module``'s head, where it has one."""
    head = _output_embeddings(module) if module is not None else None
    return head.out_features if isinstance(head, nn.Linear) else None


def batch_logits(module: nn.Module | None, batch) -> tuple[int | None, int | None]:
    """The tokens of ``batch`` whose logits a loss takes, and the logits per token,
    where known (``Loss.describe``'s arguments)."""
    source = _label_source(module) if module is not None else None
    ids = batch.kwargs.get(source) if source is not None else None
    return (ids.numel() if isinstance(ids, torch.Tensor) else None), vocab_size(module)


class StepLoss:
    """One step's loss on ``module``: the labels it adds to the batch, the head it
    chunks while entered, and the loss of the forward's output."""

    def __init__(self, module: nn.Module, loss: Loss, seed: int):
        self.module, self.loss, self.seed = module, loss, seed
        self._made: list[torch.Tensor] = []

    def batch(self, batch):
        """``batch`` with ``labels=`` for the model's own loss."""
        if self.loss.kind != "model":
            return batch
        source = _label_source(self.module)
        labels = batch.kwargs.get(source)
        if labels is None:
            raise YafsdpError(
                f"--loss model: the batch has no {source} to take labels from; use --loss ce"
            )
        return type(batch)(batch.args, {**batch.kwargs, "labels": labels})

    @contextlib.contextmanager
    def running(self):
        """What the forward and backward run under: for ``chunked-ce`` the output head
        computing the loss in chunks (its hooks still run: it is called as before);
        for ``model``, transformers' warning that a model without a ``loss_type``
        (GPT-2's class name names none) falls back to the causal-LM loss silenced:
        that fallback is the loss the model computes."""
        if self.loss.kind == "model":
            log = logging.getLogger("transformers.modeling_utils")
            level = log.level
            log.setLevel(logging.ERROR)
            try:
                yield
            finally:
                log.setLevel(level)
            return
        if self.loss.kind != "chunked-ce":
            yield
            return
        head = _output_embeddings(self.module)
        chunks, seed, made = self.loss.chunks, self.seed, self._made

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            targets = _targets(hidden.shape[:-1], head.out_features, seed, hidden.device)
            value = _ChunkedLinearCE.apply(hidden, head.weight, head.bias, targets, chunks)
            made.append(value)
            return value

        before = head.__dict__.get("forward")  # an instance's own forward, if it has one
        head.forward = forward
        try:
            yield
        finally:
            if before is None:
                del head.forward  # the class's forward again
            else:
                head.forward = before

    def __call__(self, out: Any) -> torch.Tensor:
        """The scalar the backward starts from."""
        kind = self.loss.kind
        if kind == "model":
            value = getattr(out, "loss", None)
            if value is None and isinstance(out, dict):
                value = out.get("loss")
            if not isinstance(value, torch.Tensor):
                raise YafsdpError(
                    f"--loss model: {type(self.module).__name__} returned no loss for labels="
                )
            return value
        logits = output_tensor(out)
        if kind == "projection":
            return projection_loss(logits, self.seed)
        if kind in ("ce", "fused-ce"):
            targets = _targets(logits.shape[:-1], logits.shape[-1], self.seed, logits.device)
            if kind == "fused-ce":
                return _FusedCE.apply(logits, targets)
            return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
        made, self._made = self._made, []
        if len(made) != 1 or logits is not made[0]:
            raise YafsdpError(
                f"--loss chunked-ce: {type(self.module).__name__}'s forward does not return "
                "its head's output as the logits; use --loss model"
            )
        return logits


def _targets(shape, classes: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, classes, tuple(shape), generator=g).to(device)


class _FusedCE(torch.autograd.Function):
    """Mean cross-entropy of ``logits`` against ``targets`` as a fused kernel holds it
    (see the module docstring): a log-sum-exp per token kept, the gradient made whole
    in the backward."""

    @staticmethod
    def forward(ctx, logits, targets):
        flat = logits.reshape(-1, logits.shape[-1])
        labels = targets.reshape(-1)
        lse = torch.empty(labels.numel(), dtype=torch.float32, device=logits.device)
        losses = torch.empty_like(lse)
        start = 0
        for x, t in zip(flat.chunk(FUSED_CHUNKS), labels.chunk(FUSED_CHUNKS)):
            wide = x.float()
            end = start + x.shape[0]
            lse[start:end] = torch.logsumexp(wide, dim=1)
            losses[start:end] = lse[start:end] - wide.gather(1, t.unsqueeze(1)).squeeze(1)
            del wide
            start = end
        ctx.save_for_backward(logits, lse, targets)
        return losses.sum() / labels.numel()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, targets = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        labels = targets.reshape(-1)
        scale = grad / labels.numel()
        out = torch.empty_like(flat)
        start = 0
        for x, t in zip(flat.chunk(FUSED_CHUNKS), labels.chunk(FUSED_CHUNKS)):
            end = start + x.shape[0]
            p = (x.float() - lse[start:end].unsqueeze(1)).exp_()  # softmax
            p[torch.arange(t.numel(), device=t.device), t] -= 1
            out[start:end] = p.mul_(scale)
            del p
            start = end
        return out.view_as(logits), None


class _ChunkedLinearCE(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, a chunk
    of tokens at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks):
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = targets.reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for h, t in zip(flat.chunk(chunks), labels.chunk(chunks)):
            logits = F.linear(h, weight, bias).float()
            picked = logits.gather(1, t.unsqueeze(1)).squeeze(1)
            total += (torch.logsumexp(logits, dim=1) - picked).sum()
            del logits, picked
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunks = chunks
        return total / labels.numel()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = targets.reshape(-1)
        scale = grad / labels.numel()
        grad_hidden = torch.empty_like(flat)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias) if bias is not None else None
        start = 0
        for h, t in zip(flat.chunk(ctx.chunks), labels.chunk(ctx.chunks)):
            logits = F.linear(h, weight, bias).float()
            logits = torch.softmax(logits, dim=1)  # d(lse - picked)/d logits
            rows = torch.arange(t.numel(), device=t.device)
            logits[rows, t] -= 1
            g = (logits * scale).to(hidden.dtype)
            del logits, rows
            grad_hidden[start : start + h.shape[0]] = g @ weight
            grad_weight.addmm_(g.t(), h)
            if grad_bias is not None:
                grad_bias += g.sum(0)
            start += h.shape[0]
            del g
        return grad_hidden.view_as(hidden), grad_weight, grad_bias, None, None


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    get = getattr(module, "get_output_embeddings", None)
    if not callable(get):
        return None
    try:
        head = get()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return head if isinstance(head, nn.Module) else None


def _label_source(module: nn.Module) -> str | None:
    """The batch input a model's own loss takes its labels from: the decoder's input
    ids of an encoder-decoder, else the input ids."""
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "decoder_input_ids"
    if getattr(module, "main_input_name", None) == "input_ids":
        return "input_ids"
    return None


def loss_for(module: nn.Module, step) -> StepLoss:
    """The loss of a step of ``module`` as the step options ``step`` say (their
    ``loss`` and ``seed``)."""
    inner = module
    while not callable(getattr(inner, "get_output_embeddings", None)) and isinstance(
        getattr(inner, "module", None), nn.Module
    ):
        inner = inner.module  # a wrapper's (DistributedDataParallel's) model
    return StepLoss(inner, resolve_loss(inner, step.loss), step.seed)
