"""Fuzzing the hostile-file readers for a few seconds (``python -m benchmarks.fuzz
--seconds N`` runs longer), and every crash the fuzzer found, kept as a test."""

from __future__ import annotations

import json
import re
import struct

import pytest

from benchmarks.fuzz import TARGETS, fuzz
from yafsdp_cli.checkpoint import open_flat
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.sources.safetensors_file import read_index

SECONDS = 1.5  # per target and seed: the suite's share


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_short_fuzz_finds_no_crash(tmp_path, target, seed):
    crashes, runs = fuzz(target, SECONDS, seed=seed, work=tmp_path)
    assert runs > 20, f"only {runs} inputs tried"
    assert not crashes, f"{crashes[0].error} on {crashes[0].data[:300]!r}"


def test_fuzz_reports_a_crash(tmp_path, monkeypatch):
    """The harness itself: a reader that breaks is caught, with its input."""
    from benchmarks import fuzz as fuzz_mod

    def broken(self, data):
        raise KeyError("boom")

    monkeypatch.setattr(fuzz_mod.SafetensorsTarget, "run", broken)
    crashes, _ = fuzz("safetensors", 0.2, work=tmp_path)
    assert crashes and crashes[0].error == "KeyError: 'boom'" and crashes[0].data


# ------------------------------------------------------- crashes found, kept


@pytest.mark.parametrize("value", [[0], {}, 3, None])
def test_weight_map_value_that_is_not_a_name(tmp_path, value):
    """Found by the index target: ``TypeError: unhashable type: 'list'``."""
    path = tmp_path / "m.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {"t1": "s1.safetensors", "t2": value}}))
    with pytest.raises(
        YafsdpError, match=re.escape(f"maps 't2' to {value!r}, not a shard file name")
    ):
        read_index(path)


def test_lone_surrogate_in_a_flat_checkpoint_header(tmp_path):
    """Found by the flat target: ``UnicodeEncodeError: ... surrogates not allowed``
    when the layout text, spelled ``"\\udc80"`` in JSON, was checksummed."""
    raw = b'{"__metadata__": {"format": "pt", "yafsdp.layout": "\\udc80"}}'
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(YafsdpError, match="invalid Unicode escape \\(a lone surrogate\\)"):
        open_flat(path)


@pytest.mark.parametrize(
    ("field", "spelt"),
    [(b"state_dict_metadata", b"state_dict_metadaua"), (b"properties", b"troperties")],
)
def test_a_dcp_record_without_a_field(tmp_path, field, spelt):
    """Found by the dcp target: ``AttributeError: 'TensorStorageMetadata' object has
    no attribute 'properties'`` when a field's name was garbled."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from yafsdp_cli.sources.dcp_meta import read_dcp_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    path = tmp_path / ".metadata"
    path.write_bytes(path.read_bytes().replace(field, spelt, 1))
    with pytest.raises(YafsdpError, match=f"without its '{field.decode()}' field; the metadata"):
        read_dcp_metadata(tmp_path)


@pytest.mark.parametrize(
    ("pickled", "why"),
    [
        (b"\x80\x02}}}K\x01s.", r"TypeError: unhashable type: 'dict'"),
        (
            b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n)Rs.",
            r"TypeError: .*_rebuild_tensor_v2\(\) missing",
        ),
    ],
    ids=["dict-key", "rebuild-args"],
)
def test_a_pt_whose_weights_only_load_raises(tmp_path, pickled, why):
    """Found by the pt target: torch's weights-only load raised ``TypeError`` (a dict
    as a key, a rebuild function short of arguments), which went out as an internal
    error; a weights-only load runs nothing from the file, so it is the file's damage."""
    import zipfile

    import torch

    from yafsdp_cli.sources.torch_file import load_torch_file

    base = tmp_path / "base.pt"
    torch.save({"w": torch.ones(2)}, base)
    path = tmp_path / "m.pt"
    with zipfile.ZipFile(base) as z, zipfile.ZipFile(path, "w") as out:
        for name in z.namelist():
            out.writestr(name, pickled if name.endswith("data.pkl") else z.read(name))
    with pytest.raises(YafsdpError, match=r"m\.pt: not a readable torch file \(" + why):
        load_torch_file(path, trust_pickle=False)
