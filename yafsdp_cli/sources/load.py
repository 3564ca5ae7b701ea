"""``load_source``: one entry point for every kind of source."""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError
from ..fileio import require_file, require_inside
from .files import load_file, weights_in_folder
from .loaded import LoadedModel


def load_source(
    source: str | Path | None,
    *,
    model: str | None = None,
    trust_pickle: bool = False,
) -> LoadedModel:
    """Load ``source`` (a file or folder) and/or the ``model`` factory."""
    if source is None and model is None:
        raise SourceError("give a SOURCE file or folder, or --model package.module:factory")
    loaded = _load_path(Path(source), trust_pickle) if source is not None else None
    if model is None:
        return loaded
    from .factory import attach_factory

    return attach_factory(model, loaded)


def _load_path(path: Path, trust_pickle: bool) -> LoadedModel:
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder")
    if path.is_dir():
        return _load_folder(path, trust_pickle)
    require_file(path)  # a FIFO or device would block or never end
    return load_file(path, trust_pickle)


def _load_folder(path: Path, trust_pickle: bool) -> LoadedModel:
    from .peft_folder import CONFIG, WEIGHTS, is_adapter_folder, load_adapter_folder

    # the files read by name (here, by transformers and by peft): never through a link
    # out of the folder; the weights found by pattern are checked where they are found
    for name in (CONFIG, *WEIGHTS, "config.json"):
        require_inside(path, path / name)
    if is_adapter_folder(path):
        return load_adapter_folder(
            path, lambda base: _load_path(base, trust_pickle), trust_pickle=trust_pickle
        )
    if (path / "config.json").is_file():
        from .hf import load_hf_folder

        return load_hf_folder(path, trust_pickle=trust_pickle)
    weights = weights_in_folder(path)
    if weights is None:
        raise SourceError(
            f"{path}: a folder with neither config.json nor model weights "
            "(safetensors, .bin/.pt, or a DCP checkpoint's .metadata)"
        )
    return _load_path(weights, trust_pickle)
