"""``torch.export`` programs (``*.pt2``): refused without --trust-pickle; ties, module
kinds and buffers recovered from the program."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from typer.testing import CliRunner

from tests.helpers import build
from yafsdp_cli import SourceError
from yafsdp_cli.cli import app
from yafsdp_cli.engine.inputs import make_input, projection_loss
from yafsdp_cli.sources import load_source

runner = CliRunner()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    out = {}
    folder = tmp_path_factory.mktemp("pt2")
    for name in ("gpt", "cnn"):
        model = build(name).eval()
        program = torch.export.export(model, (make_input(model),))
        torch.export.save(program, folder / f"{name}.pt2")
        out[name] = (folder / f"{name}.pt2", model)
    return out


def test_refused_without_trust_pickle(programs):
    path, _ = programs["gpt"]
    with pytest.raises(SourceError, match="torch.export.load unpickles .* --trust-pickle"):
        load_source(path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2 and "--trust-pickle" in result.stderr


def test_tied_weights_are_one_tensor_again(programs):
    path, model = programs["gpt"]
    loaded = load_source(path, trust_pickle=True)
    wte = loaded.spec.by_name()["transformer.wte.weight"]
    assert wte.aliases == ("lm_head.weight",)
    assert len(loaded.spec.params) == len(list(model.parameters()))
    assert loaded.spec.units == ("transformer.h.0", "transformer.h.1")
    module = loaded.build_module()
    assert module.lm_head.weight is module.transformer.wte.weight
    x = make_input(model)
    torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)
    projection_loss(module(x)).backward()
    projection_loss(model(x)).backward()
    torch.testing.assert_close(module.lm_head.weight.grad, model.lm_head.weight.grad)


def test_kinds_and_buffers_from_the_graph(programs):
    path, model = programs["cnn"]
    loaded = load_source(path, trust_pickle=True)
    by_name = loaded.spec.by_name()
    assert by_name["features.0.weight"].kinds == ("conv",)
    assert by_name["features.1.weight"].kinds == ("norm",)
    assert by_name["classifier.weight"].module_types == ("Linear",)
    assert not by_name["features.1.running_mean"].is_param
    result = runner.invoke(
        app, ["inspect", str(path), "--trust-pickle", "--filter", "conv", "--json"]
    )
    assert result.exit_code == 0, result.output
    names = {e["name"] for b in json.loads(result.stdout)["buffers"] for e in b["entries"]}
    assert names == {f"features.{i}.{p}" for i in (0, 4) for p in ("weight", "bias")}


def test_a_pt2_that_is_not_a_program(tmp_path):
    path = tmp_path / "fake.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fake/data.txt", "hello")
    with pytest.raises(SourceError, match="not a loadable torch.export program"):
        load_source(path, trust_pickle=True)
    (tmp_path / "junk.pt2").write_bytes(b"junk")
    result = runner.invoke(app, ["inspect", str(tmp_path / "junk.pt2"), "--trust-pickle"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
