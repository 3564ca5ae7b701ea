"""One loader for every kind of model source.

``load_source`` turns a path (and/or ``--model``) into a ``LoadedModel``: a
``ModelSpec`` for layouts and memory, a reader for tensor bytes when there are
weights, and the architecture as a module when one is known (on the meta device,
so describing it costs no memory; ``LoadedModel.build_module()`` makes a real one).
Downstream code never asks where a model came from.

Source kinds: ``*.safetensors`` and ``*.safetensors.index.json`` (header only, no
torch import), ``*.pt/.pth/.bin`` state dicts, pickled modules (``--trust-pickle``),
Hugging Face folders (``config.json``; the ``hf`` extra), ``--model module:factory``
with or without weights, ``torch.export`` programs (``*.pt2``), and
``torch.distributed.checkpoint`` (DCP) folders (``.metadata`` + ``*.distcp``; read
without importing torch, as their chunks are ``torch.save`` archives read by range).

Modules: ``loaded`` (``LoadedModel``), ``load`` (``load_source``), ``files`` (weight
files by kind: ``safetensors_file``, ``torch_file``, ``shards`` for sharded sets),
``hf`` and ``hf_readers`` (Hugging Face folders), ``factory`` (``--model``),
``export`` (``*.pt2``), ``dcp_folder``, ``dcp_meta``, ``dcp_pickle``, ``dcp_data`` and
``state`` (DCP folders), ``torch_archive`` and ``torch_pickle`` (``torch.save``
archives read and written without torch, for DCP's chunks and ``restore``),
``train_state`` (a training checkpoint's optimizer state and other entries, DCP and
``torch.save``), ``adapted`` (a source as fine-tuning trains it: peft's LoRA added,
``--freeze`` marked; the ``peft`` extra) and ``peft_folder`` (a PEFT adapter folder
over its local base). This package may import ``engine``, ``errors`` and ``fileio``;
it never imports verify, profiling, checkpoint or the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy

# Where each public name lives: reading a flat checkpoint's safetensors header
# imports ``safetensors_file`` alone, not every loader (``lazy.py`` says why).
_HOMES = {
    **dict.fromkeys(
        ("TORCH_SUFFIXES", "natural_key", "spec_from_tensors", "weights_in_folder", "with_spec"),
        "files",
    ),
    "load_source": "load",
    **dict.fromkeys(("NO_ARCH_NOTE", "LoadedModel", "TensorReader"), "loaded"),
}

if TYPE_CHECKING:
    from .files import TORCH_SUFFIXES, natural_key, spec_from_tensors, weights_in_folder, with_spec
    from .load import load_source
    from .loaded import NO_ARCH_NOTE, LoadedModel, TensorReader


def __getattr__(name: str):
    return lazy.attribute(__name__, _HOMES, name)


__all__ = [
    "NO_ARCH_NOTE",
    "TORCH_SUFFIXES",
    "LoadedModel",
    "TensorReader",
    "load_source",
    "natural_key",
    "spec_from_tensors",
    "weights_in_folder",
    "with_spec",
]
