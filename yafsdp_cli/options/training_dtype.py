"""One rule for the dtype a model is trained in, which every command follows.

``--param-dtype`` wins. Else a source that stores its dtype (every weights file, an
HF config with ``dtype``/``torch_dtype``) is trained as stored, except by ``plan``,
whose default is the mixed precision people train in. A source that records no
dtype (an HF config saved by transformers 5 from a config built in code) is trained
in ``DEFAULT_TRAINING_DTYPE`` by every command, ``plan``'s default, so that
``inspect``, ``profile``, ``check`` and ``plan`` give the same model the same bytes
per parameter instead of torch's float32 in some and bfloat16 in others.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import dtypes
from ..engine.records import ModelSpec

DEFAULT_TRAINING_DTYPE = "bfloat16"


@dataclass(frozen=True, slots=True)
class TrainingDtype:
    dtype: str | None  # canonical name; None: each parameter's stored dtype
    why: str  # one line for a report's first lines: which dtype and why


def training_dtype(requested: str | None, spec: ModelSpec) -> TrainingDtype:
    """The dtype ``spec``'s floating parameters are trained in, given ``--param-dtype``
    (``requested``, None when not given).

    >>> from yafsdp_cli.engine.records import TensorRecord
    >>> spec = ModelSpec((TensorRecord("w", (2, 2), "float32"),), False, dtype_stored=False)
    >>> training_dtype(None, spec).dtype
    'bfloat16'
    """
    if requested:
        name = dtypes.canonical(requested)
        return TrainingDtype(name, f"parameters in {name} (--param-dtype)")
    if not spec.dtype_stored:
        return TrainingDtype(
            DEFAULT_TRAINING_DTYPE,
            f"parameters in {DEFAULT_TRAINING_DTYPE}: the source stores no dtype (plan's "
            "default; --param-dtype sets another)",
        )
    stored = sorted({t.dtype for t in spec.params if t.floating})
    return TrainingDtype(None, f"parameters in their stored dtype ({', '.join(stored) or 'none'})")
