"""Bad safetensors files, index sets and Hugging Face folders, written into a folder.

Each builder takes the folder to write into and returns the path to hand the
command; ``CASES`` pairs it with the words the one error line must hold.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .common import Case

SOURCE_COMMANDS = ("inspect", "convert", "verify", "profile", "check")


def st_bytes(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(shape=(2,), begin=0, end=None, dtype="F32") -> dict:
    end = begin + 4 * _prod(shape) if end is None else end
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def good_header() -> dict:
    return {"a.weight": entry((2, 3)), "b.bias": entry((3,), begin=24)}


GOOD_DATA = bytes(range(36))


def write_st(folder: Path, header, data: bytes = GOOD_DATA, length=None, name="x") -> Path:
    path = folder / f"{name}.safetensors"
    path.write_bytes(st_bytes(header, data, length))
    return path


def _cut(at_from_end: int | None = None, keep: int | None = None):
    def build(folder: Path) -> Path:
        path = write_st(folder, good_header())
        raw = path.read_bytes()
        path.write_bytes(raw[:keep] if keep is not None else raw[:-at_from_end])
        return path

    return build


def _header(header_fn, data: bytes = GOOD_DATA, length=None):
    return lambda folder: write_st(folder, header_fn(), data, length)


def _with(**entries):
    def header():
        h = good_header()
        h.update(entries)
        return h

    return header


def _nested() -> bytes:
    depth = 200_000
    return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"


def _duplicate() -> bytes:
    a = json.dumps(entry((2, 3)))
    return f'{{"a.weight": {a}, "a.weight": {a}}}'.encode()


def _fifo(folder: Path) -> Path:
    path = folder / "x.safetensors"
    os.mkfifo(path)
    return path


def _directory(folder: Path) -> Path:
    path = folder / "x.safetensors"
    path.mkdir()
    return path


def _empty(folder: Path) -> Path:
    path = folder / "x.safetensors"
    path.write_bytes(b"")
    return path


ST = "|".join(SOURCE_COMMANDS)
SAFETENSORS = [
    Case("st-truncated-header", _cut(keep=20), "header length 140 is impossible for a 20-byte"),
    Case("st-truncated-data", _cut(at_from_end=5), "truncated: the header describes 36 bytes"),
    Case("st-header-length-2^63", _header(good_header, length=2**63), "header length 9223372"),
    Case("st-json-array", _header(lambda: b"[1, 2]", b""), "header is not a JSON object"),
    Case("st-deeply-nested", _header(_nested, b""), "header is nested too deeply"),
    Case("st-duplicate-keys", _header(_duplicate, GOOD_DATA[:24]), "names tensor 'a.weight' twice"),
    Case(
        "st-unknown-dtype",
        _header(_with(**{"b.bias": entry((3,), 24, dtype="Q7")})),
        "tensor 'b.bias' has unknown dtype 'Q7'",
    ),
    Case(
        "st-negative-shape",
        _header(_with(**{"b.bias": {**entry((3,), 24), "shape": [-3]}})),
        "tensor 'b.bias' has a bad shape \\[-3\\]",
    ),
    Case(
        "st-float-shape",
        _header(_with(**{"b.bias": {**entry((3,), 24), "shape": [3.0]}})),
        "tensor 'b.bias' has a bad shape \\[3.0\\]",
    ),
    Case(
        "st-shape-overflows-int64",
        _header(_with(**{"b.bias": {**entry((3,), 24), "shape": [2**33, 2**33, 3]}})),
        "tensor 'b.bias' has a bad shape .* more than 2\\^63 bytes",
    ),
    Case(
        "st-offsets-overlap",
        _header(_with(**{"b.bias": entry((3,), 20)}), GOOD_DATA[:32]),
        "tensor 'b.bias' at offset 20 overlaps the previous tensor",
    ),
    Case(
        "st-offsets-out-of-range",
        _header(_with(**{"b.bias": entry((3,), 2**62)})),
        "tensor 'b.bias' at offset 4611686018427387904 leaves a hole at 24",
    ),
    Case(
        "st-offsets-past-the-end",
        _header(_with(**{"b.bias": entry((3,), 24)}), GOOD_DATA[:30]),
        "truncated: the header describes 36 bytes of data, the file has 30",
    ),
    Case(
        "st-offsets-hole",
        _header(_with(**{"b.bias": entry((3,), 28)}), GOOD_DATA + bytes(4)),
        "tensor 'b.bias' at offset 28 leaves a hole at 24",
    ),
    Case("st-not-utf8", _header(lambda: b'{"\xff\xfe": 1}', b""), "header is not valid UTF-8"),
    Case(
        "st-metadata-not-strings",
        _header(_with(__metadata__={"format": 1})),
        "__metadata__ must map strings to strings",
    ),
    Case(
        "st-metadata-not-object",
        _header(_with(__metadata__=["pt"])),
        "__metadata__ must map strings to strings",
    ),
    Case("st-empty-file", _empty, "not a safetensors file \\(only 0 bytes\\)"),
    Case("st-directory", _directory, "a folder with neither config.json nor model weights"),
    Case("st-fifo", _fifo, "not a regular file"),
]
for _c in SAFETENSORS:
    _c.commands = SOURCE_COMMANDS


# ---------------------------------------------------------------- index sets


def _index_set(folder: Path, weight_map: dict, shards: dict[str, dict] | None = None) -> Path:
    shards = shards if shards is not None else {"s1.safetensors": good_header()}
    for name, header in shards.items():
        (folder / name).write_bytes(st_bytes(header, GOOD_DATA))
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _set_escaping(name: str):
    def build(folder: Path) -> Path:
        (folder / "outside.safetensors").write_bytes(st_bytes(good_header(), GOOD_DATA))
        inner = folder / "set"
        inner.mkdir()
        return _index_set(inner, {"a.weight": name, "b.bias": name}, {})

    return build


def _set_symlink_out(folder: Path) -> Path:
    (folder / "outside.safetensors").write_bytes(st_bytes(good_header(), GOOD_DATA))
    inner = folder / "set"
    inner.mkdir()
    (inner / "s1.safetensors").symlink_to(folder / "outside.safetensors")
    return _index_set(inner, {"a.weight": "s1.safetensors", "b.bias": "s1.safetensors"}, {})


def _set(weight_map: dict):
    return lambda folder: _index_set(folder, weight_map)


INDEXES = [
    Case("index-dotdot", _set_escaping("../outside.safetensors"), "outside its folder"),
    Case("index-absolute", _set_escaping("/etc/passwd"), "'/etc/passwd', outside its folder"),
    Case("index-symlink-out", _set_symlink_out, "a link to .*outside.safetensors, outside"),
    Case(
        "index-missing-shard",
        _set({"a.weight": "s1.safetensors", "b.bias": "s2.safetensors"}),
        "weight_map names 's2.safetensors', which does not exist",
    ),
    Case(
        "index-tensor-not-in-shard",
        _set({"a.weight": "s1.safetensors", "b.bias": "s1.safetensors", "c": "s1.safetensors"}),
        "weight_map puts 'c' in s1.safetensors, but no shard it names has it",
    ),
    Case(
        "index-not-json",
        lambda f: _write(f / "m.safetensors.index.json", "{nope"),
        "not valid JSON",
    ),
    Case(
        "index-no-weight-map",
        lambda f: _write(f / "m.safetensors.index.json", "[]"),
        "no weight_map",
    ),
]
for _c in INDEXES:
    _c.commands = SOURCE_COMMANDS


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- HF folders

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}


def _hf(edit: dict | None = None, text: str | None = None, code: str | None = None):
    def build(folder: Path) -> Path:
        model = folder / "model"
        model.mkdir()
        config = text if text is not None else json.dumps({**GPT2, **(edit or {})})
        (model / "config.json").write_text(config)
        (model / "model.safetensors").write_bytes(st_bytes(good_header(), GOOD_DATA))
        if code is not None:
            (model / "modeling_evil.py").write_text(code)
        return model

    return build


EVIL_CODE = (
    "from pathlib import Path\n"
    "Path(__file__).parent.parent.joinpath('PWNED').write_text('ran')\n"
    "from transformers import GPT2Config as EvilConfig, GPT2LMHeadModel as EvilModel\n"
)
HF = [
    Case(
        "hf-auto-map",
        _hf(
            {
                "auto_map": {
                    "AutoConfig": "modeling_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.EvilModel",
                },
                "architectures": ["EvilModel"],
            },
            code=EVIL_CODE,
        ),
        "pass --trust-pickle",
        "hf",
    ),
    Case(
        "hf-unknown-model-type",
        _hf({"model_type": "no-such-model"}),
        "transformers cannot read it",
        "hf",
    ),
    Case(
        "hf-quantization-config",
        _hf({"quantization_config": {"quant_method": "gptq"}}),
        "a gptq checkpoint .* quantized weights are not supported",
        "hf",
    ),
    Case("hf-config-not-json", _hf(text="{model_type: gpt2"), "config.json: not valid JSON", "hf"),
    Case("hf-config-not-object", _hf(text="[1]"), "config.json: not a JSON object", "hf"),
]
for _c in HF:
    _c.commands = SOURCE_COMMANDS
