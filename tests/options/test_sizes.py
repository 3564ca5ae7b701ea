"""Sizes on the command line: a unit is required, SI units are echoed in GiB, and
errors name the option the user typed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.gpu_table import MIB
from yafsdp_cli.options import check_reserve, parse_size, si_echo
from yafsdp_cli.planning import gpu_memory_notes
from yafsdp_cli.timing.gpu_specs import gpu_spec

runner = CliRunner()
GPT = ["plan", "--model", "sample_models.models:gpt"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80G", 80 * 2**30),
        ("81559MiB", 81559 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("80GB", 80 * 10**9),
        ("2TB", 2 * 10**12),
        ("0", 0),
        ("1024B", 1024),
    ],
)
def test_sizes_parse_in_their_units(text, expected):
    assert parse_size(text, "--gpu-memory") == expected


@pytest.mark.parametrize("text", ["80", "1.5", "2048"])
def test_a_size_without_a_unit_is_an_error_that_suggests_gib(text):
    with pytest.raises(YafsdpError, match=rf"^--reserve {text}: a size needs a unit, e\.g\. "):
        parse_size(text, "--reserve")


def test_si_sizes_are_echoed_in_gib_binary_ones_are_not():
    echo = si_echo("80GB", "--gpu-memory")
    assert echo is not None
    assert "80,000,000,000 bytes" in echo and f"{80e9 / 2**30:.2f} GiB" in echo
    assert si_echo("80GiB", "--gpu-memory") is None
    assert si_echo("80G", "--gpu-memory") is None


def test_gpu_memory_in_gb_names_the_gpus_sold_as_that_size():
    echo, hint = gpu_memory_notes("80GB")
    assert f"{80e9 / 2**30:.2f} GiB" in echo
    h100 = gpu_spec("H100-SXM").memory_bytes // MIB
    assert f"{h100:,} MiB" in hint and f"--gpu-memory {h100}MiB" in hint
    assert f"{gpu_spec('A100-80GB').memory_bytes // MIB:,} MiB" in hint
    assert "A100-40GB" not in hint and "H200" not in hint
    assert gpu_spec("H200").name in gpu_memory_notes("141GB")[1]
    assert gpu_memory_notes("3GB") == (si_echo("3GB", "--gpu-memory"),)  # no such GPU
    assert gpu_memory_notes("80GiB") == ()


def test_the_reserve_check_blames_the_option_typed():
    with pytest.raises(YafsdpError, match=r"^--gpu-memory 1\.00 GiB leaves nothing beside the 2"):
        check_reserve(2**30, 2 * 2**30, reserve_typed=False)
    with pytest.raises(YafsdpError, match=r"^--reserve 2\.00 GiB must be below --gpu-memory"):
        check_reserve(2**30, 2 * 2**30, reserve_typed=True)
    check_reserve(2**30, 0, reserve_typed=True)


@pytest.mark.parametrize(
    ("args", "message", "not_blamed"),
    [
        (["--gpu-memory", "80"], "--gpu-memory 80: a size needs a unit, e.g. 80GiB", "--reserve"),
        (["--gpu-memory", "512MiB"], "--gpu-memory 512.00 MiB leaves nothing", "--reserve"),
        (["--gpu-memory", "80GiB", "--reserve", "2"], "--reserve 2: a size needs a unit", None),
        (["--gpu-memory", "1GiB", "--reserve", "1GiB"], "--reserve 1.00 GiB must be below", None),
        (["--gpu-memory", "0"], "--gpu-memory must be positive", None),
    ],
)
def test_plan_size_errors_name_the_option_typed(args, message, not_blamed):
    result = runner.invoke(app, [*GPT, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    if not_blamed is not None:
        assert not result.stderr.startswith(f"error: {not_blamed}")


def test_plan_in_gb_echoes_the_gib_figure_and_keeps_json_clean():
    grid = ["--world-size", "2", "--micro-batch", "1", "--checkpointing", "none"]
    args = [*GPT, "--gpu-memory", "1600KB", "--reserve", "0", "--seq-len", "16", *grid]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["gpu_memory_bytes"] == 1_600_000
    assert "note: --gpu-memory 1600KB is 1,600,000 bytes = 1.53 MiB" in result.stderr
