"""What a fine-tuning step trains: ``--lora``'s text, parsed.

``--lora r=16,alpha=32,targets=q_proj,v_proj`` is one string on the command line and
in every saved document (a baseline records it as given); ``parse_lora`` turns it
into ``LoraSettings`` and is what validates it. ``targets`` is peft's
``target_modules`` (module names, comma-separated, or ``all-linear``), ``alpha``
its ``lora_alpha`` (default: r), ``dropout`` its ``lora_dropout``. Nothing here
imports torch or peft.

``rank_problem``, ``alpha_problem`` and ``dropout_problem`` are the rules for those
three numbers wherever they come from (``--lora`` here, an adapter folder's
``adapter_config.json`` in ``sources.peft_folder``): a whole rank from 1 to
``MAX_RANK``, a finite alpha above 0, a dropout in [0, 1). Whether a rank fits the
layers it targets is checked where the layers are known (``sources.adapted``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import YafsdpError, excerpt

_LORA_SYNTAX = "write it like r=16,alpha=32,targets=q_proj,v_proj"
# A rank is a layer's width: past int32 it is no layer's, and torch's sizes of
# rank x features would overflow before the check against the layers could run
MAX_RANK = 2**31 - 1


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """peft's ``LoraConfig`` fields the memory of a step depends on."""

    r: int
    alpha: float
    targets: tuple[str, ...]  # module names (peft's target_modules); ("all-linear",) works
    dropout: float = 0.0


def parse_lora(text: str) -> LoraSettings:
    """``"r=16,alpha=32,targets=q_proj,v_proj"`` -> ``LoraSettings``; raises
    ``YafsdpError`` naming what is wrong. A part without ``=`` continues the
    ``targets`` list, so module names are separated by commas as everywhere else."""
    if not isinstance(text, str):  # a baseline's recorded inputs are a file's
        raise YafsdpError(f"--lora {excerpt(text)} is not text; {_LORA_SYNTAX}")
    fields: dict[str, str] = {}
    targets: list[str] = []
    last = None
    for part in (p.strip() for p in text.split(",")):
        key, eq, value = part.partition("=")
        if eq and key in ("r", "alpha", "dropout", "targets"):
            last = key
            if key == "targets":
                targets += [value] if value else []
            else:
                fields[key] = value
        elif part and not eq and last == "targets":
            targets.append(part)
        elif part:
            raise YafsdpError(
                f"--lora {excerpt(text)}: cannot read {excerpt(part)}; {_LORA_SYNTAX}"
            )
    if last is None or "r" not in fields:
        raise YafsdpError(f"--lora {excerpt(text)} has no rank r=N; {_LORA_SYNTAX}")
    if not targets:
        raise YafsdpError(f"--lora {excerpt(text)} names no targets; {_LORA_SYNTAX}")
    r = _number(text, "r", fields["r"], int)
    alpha = _number(text, "alpha", fields.get("alpha", str(r)), float)
    dropout = _number(text, "dropout", fields.get("dropout", "0"), float)
    for key, value, problem in (
        ("r", r, rank_problem),
        ("alpha", alpha, alpha_problem),
        ("dropout", dropout, dropout_problem),
    ):
        wrong = problem(value)
        if wrong:
            raise YafsdpError(f"--lora {excerpt(text)}: {key}={fields.get(key, value)} {wrong}")
    return LoraSettings(r=r, alpha=alpha, targets=tuple(targets), dropout=dropout)


def _number(text: str, key: str, value: str, kind):
    try:
        return kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise YafsdpError(f"--lora {excerpt(text)}: {key}={excerpt(value)} is not {what}") from None


def rank_problem(value) -> str | None:
    """What is wrong with ``value`` as a LoRA rank, or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "is not a whole number"
    if value < 1:
        return "must be at least 1"
    if value > MAX_RANK:
        return f"is above {MAX_RANK:,}, wider than any layer"
    return None


def alpha_problem(value) -> str | None:
    """What is wrong with ``value`` as LoRA's alpha (the scale is alpha / r), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "is not a number"
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        finite = False
    return None if finite and value > 0 else "must be a finite number above 0"


def dropout_problem(value) -> str | None:
    """What is wrong with ``value`` as LoRA's dropout probability, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "is not a number"
    return None if 0 <= value < 1 else "must be in [0, 1)"  # NaN is neither
