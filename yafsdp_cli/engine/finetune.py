"""What a fine-tuning step trains: ``--lora``'s text, parsed.

``--lora r=16,alpha=32,targets=q_proj,v_proj`` is one string on the command line and
in every saved document (a baseline records it as given); ``parse_lora`` turns it
into ``LoraSettings`` and is what validates it. ``targets`` is peft's
``target_modules`` (module names, comma-separated, or ``all-linear``), ``alpha``
its ``lora_alpha`` (default: r), ``dropout`` its ``lora_dropout``. Nothing here
imports torch or peft.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError

_LORA_SYNTAX = "write it like r=16,alpha=32,targets=q_proj,v_proj"


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
            raise YafsdpError(f"--lora {text!r}: cannot read {part!r}; {_LORA_SYNTAX}")
    if last is None or "r" not in fields:
        raise YafsdpError(f"--lora {text!r} has no rank r=N; {_LORA_SYNTAX}")
    if not targets:
        raise YafsdpError(f"--lora {text!r} names no targets; {_LORA_SYNTAX}")
    r = _number(text, "r", fields["r"], int)
    alpha = _number(text, "alpha", fields.get("alpha", str(r)), float)
    dropout = _number(text, "dropout", fields.get("dropout", "0"), float)
    if r < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise YafsdpError(
            f"--lora {text!r}: r must be at least 1, alpha positive and dropout in [0, 1)"
        )
    return LoraSettings(r=r, alpha=alpha, targets=tuple(targets), dropout=dropout)


def _number(text: str, key: str, value: str, kind):
    try:
        return kind(value)
    except ValueError:
        raise YafsdpError(f"--lora {text!r}: {key}={value!r} is not a number") from None
