"""Fuzzing the readers that face hostile files: safetensors headers, index files, flat
checkpoints (their layout metadata included), ``.pt`` files, DCP ``.metadata`` pickles,
GPU profiles and PEFT adapter configs (with peft and transformers installed).

Each target starts from a valid file, mutates it (bytes: flips, interesting values,
cuts, repeats; JSON: a value replaced by a hostile one), and hands it to the reader.
The reader must either accept the file or raise a ``YafsdpError``; anything else (a
``KeyError``, a ``RecursionError``, a ``MemoryError``, a hang) is a crash, printed
with the input that caused it so that it can become a test.

    python -m benchmarks.fuzz --seconds 60            # every target, 60 s each
    python -m benchmarks.fuzz --seconds 10 --target flat --seed 7
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from yafsdp_cli.options import LayoutOptions

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_VALUES = (
    -1,
    0,
    2**31,
    2**63,
    2**64 + 1,
    1.5,
    "",
    "x",
    "F32",
    None,
    True,
    [],
    [0],
    [-1, 3],
    {},
    {"a": 1},
    "\udc80",
)


@dataclass(frozen=True)
class Crash:
    target: str
    error: str  # type and message of the unexpected exception
    data: bytes  # the file that caused it


# ---------------------------------------------------------------- mutations


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(out)) if out else 0
        if op == 0 and out:
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[at] = rng.choice((0, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("-"), ord("9")))
        elif op == 2:
            del out[at:]
        elif op == 3:
            out[at:at] = out[at : at + rng.randint(1, 64)]
        elif op == 4:
            del out[at : at + rng.randint(1, 16)]
        elif op == 5 and len(out) >= 8 and at < len(out) - 8:
            out[at : at + 8] = struct.pack("<Q", rng.choice((0, 1, 2**63, 2**64 - 1, len(out))))
    return bytes(out)


def mutate_json(doc, rng: random.Random, depth: int = 0):
    """``doc`` with one value somewhere replaced by a hostile one."""
    if isinstance(doc, dict) and doc and depth < 12:
        key = rng.choice(list(doc))
        if rng.random() < 0.15:
            return {k: v for k, v in doc.items() if k != key}
        return {**doc, key: mutate_json(doc[key], rng, depth + 1)}
    if isinstance(doc, list) and doc and depth < 12:
        i = rng.randrange(len(doc))
        return doc[:i] + [mutate_json(doc[i], rng, depth + 1)] + doc[i + 1 :]
    if isinstance(doc, str) and doc.startswith(("{", "[")) and rng.random() < 0.7:
        try:  # metadata values that are JSON themselves (the flat layout)
            return json.dumps(mutate_json(json.loads(doc), rng, depth + 1))
        except ValueError:
            pass
    if isinstance(doc, int) and not isinstance(doc, bool) and rng.random() < 0.5:
        return doc + rng.choice((-1, 1, 8, -8, 2**40))
    return rng.choice(HOSTILE_VALUES)


def _dumps(doc) -> bytes:
    return json.dumps(doc).encode("utf-8", "surrogatepass")


def st_file(header: dict, data: bytes) -> bytes:
    raw = _dumps(header)
    return struct.pack("<Q", len(raw)) + raw + data


def split_st(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


# ---------------------------------------------------------------- targets


class Target:
    """A reader and the valid seed files it is fuzzed from, in a work folder."""

    name = ""

    def __init__(self, work: Path):
        self.work = work

    def mutant(self, rng: random.Random) -> bytes:
        seed = self.seed
        if rng.random() < 0.5:
            return mutate_bytes(seed, rng)
        header, data = split_st(seed)
        return st_file(mutate_json(header, rng), data)

    def run(self, data: bytes) -> None:
        raise NotImplementedError


class SafetensorsTarget(Target):
    name = "safetensors"

    def __init__(self, work: Path):
        super().__init__(work)
        header = {
            "__metadata__": {"format": "pt"},
            "a.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b.bias": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        }
        self.seed = st_file(header, bytes(range(32)))

    def run(self, data: bytes) -> None:
        from yafsdp_cli.sources.safetensors_file import SafetensorsReader, read_header

        path = self.work / "x.safetensors"
        path.write_bytes(data)
        reader = SafetensorsReader([read_header(path)])
        for name in reader.names():
            reader.load(name)


class IndexTarget(Target):
    name = "index"

    def __init__(self, work: Path):
        super().__init__(work)
        for i in (1, 2):
            header = {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
            (work / f"s{i}.safetensors").write_bytes(st_file(header, bytes(8)))
        index = {"metadata": {}, "weight_map": {"t1": "s1.safetensors", "t2": "s2.safetensors"}}
        self.seed = _dumps(index)

    def mutant(self, rng: random.Random) -> bytes:
        if rng.random() < 0.3:
            return mutate_bytes(self.seed, rng)
        return _dumps(mutate_json(json.loads(self.seed), rng))

    def run(self, data: bytes) -> None:
        from yafsdp_cli.sources.safetensors_file import read_index

        path = self.work / "m.safetensors.index.json"
        path.write_bytes(data)
        read_index(path)


class FlatTarget(Target):
    name = "flat"

    def __init__(self, work: Path):
        super().__init__(work)
        from yafsdp_cli.checkpoint import convert_checkpoint

        flat = work / "seed.safetensors"
        convert_checkpoint(
            ROOT / "sample_models" / "cnn.safetensors", flat, LayoutOptions(world_size=2)
        )
        self.seed = flat.read_bytes()

    def mutant(self, rng: random.Random) -> bytes:
        header, data = split_st(self.seed)
        if rng.random() < 0.3:  # bytes of the header only: the data is checksummed
            raw = mutate_bytes(_dumps(header), rng)
            return struct.pack("<Q", len(raw)) + raw + data
        return st_file(mutate_json(header, rng), data)

    def run(self, data: bytes) -> None:
        from yafsdp_cli.checkpoint import open_flat

        path = self.work / "f.safetensors"
        path.write_bytes(data)
        open_flat(path).verify()


class DcpTarget(Target):
    """A DCP folder's ``.metadata``: a pickle, read by the allow-list unpickler, then
    every chunk checked against the folder's ``.distcp`` files."""

    name = "dcp"

    def __init__(self, work: Path):
        super().__init__(work)
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        self.folder = work / "ckpt"
        state = {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.ones(5, dtype=torch.bfloat16),
            "step": 3,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(self.folder), no_dist=True)
        self.seed = (self.folder / ".metadata").read_bytes()

    def mutant(self, rng: random.Random) -> bytes:
        return mutate_bytes(self.seed, rng)

    def run(self, data: bytes) -> None:
        from yafsdp_cli.sources.dcp_folder import open_dcp

        (self.folder / ".metadata").write_bytes(data)
        weights = open_dcp(self.folder)
        for name in weights.reader.names():
            weights.reader.load(name)


class TorchFileTarget(Target):
    """A ``.pt`` file: its ``data.pkl`` mutated inside a well-formed zip archive (so
    that the pickle, not the zip, is what is tried), or the archive's bytes as they
    are; read by ``load_torch_file`` (the opcode check, then torch's weights-only
    load) and every tensor of the state dict found in it."""

    name = "pt"

    def __init__(self, work: Path):
        super().__init__(work)
        import io
        import zipfile

        import torch

        buf = io.BytesIO()
        state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
        torch.save({"model": state, "step": 3, "names": ("w", "b")}, buf)
        self.seed = buf.getvalue()
        with zipfile.ZipFile(io.BytesIO(self.seed)) as z:
            self.members = [(n, z.read(n)) for n in z.namelist()]

    def mutant(self, rng: random.Random) -> bytes:
        import io
        import zipfile

        if rng.random() < 0.2:
            return mutate_bytes(self.seed, rng)
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for name, data in self.members:
                z.writestr(name, mutate_bytes(data, rng) if name.endswith("data.pkl") else data)
        return out.getvalue()

    def run(self, data: bytes) -> None:
        import warnings

        from yafsdp_cli.sources.torch_file import find_state_dict, load_torch_file

        path = self.work / "m.pt"
        path.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj, _ = load_torch_file(path, trust_pickle=False)
            find_state_dict(obj, path)


class GpuProfileTarget(Target):
    """A ``--gpu-profile`` file: a GPU's figures and measured efficiencies."""

    name = "gpu-profile"

    def __init__(self, work: Path):
        super().__init__(work)
        doc = {
            "name": "fuzz-gpu",
            "memory_bytes": 80 * 2**30,
            "bf16_tflops": 989.0,
            "fp32_tflops": 67.0,
            "hbm_gbps": 3350.0,
            "link_gbps": 450.0,
            "gpus_per_node": 8,
            "efficiency": {"matrix": 0.6, "memory": 0.8, "kernel_floor_us": 4.0},
            "calibration": {"by": "fuzz"},
        }
        self.seed = _dumps(doc)

    def mutant(self, rng: random.Random) -> bytes:
        if rng.random() < 0.3:
            return mutate_bytes(self.seed, rng)
        doc = json.loads(self.seed)
        for _ in range(rng.randint(1, 3)):
            doc = mutate_json(doc, rng)
        text = _dumps(doc)
        if rng.random() < 0.2:  # the literals Python's json writes and reads
            text = text.replace(b"989.0", rng.choice((b"NaN", b"Infinity", b"-Infinity", b"1e400")))
        return text

    def run(self, data: bytes) -> None:
        import math

        from yafsdp_cli.timing.gpu_profile import load_profile

        path = self.work / "gpu.json"
        path.write_bytes(data)
        profile = load_profile(path)
        gpu = profile.gpu
        figures = (gpu.memory_bytes, gpu.bf16_flops, gpu.fp32_flops, gpu.hbm_bytes_per_s)
        for value in (*figures, gpu.link_bytes_per_s, profile.efficiency.matrix):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"accepted a figure that is not finite and positive: {value}")


class PeftTarget(Target):
    """``adapter_config.json`` of a LoRA adapter over a config-only tiny Llama, loaded
    as a source: the checks of the config, then peft building the adapter on the
    meta device and the weights' shapes checked against it."""

    name = "peft"

    def __init__(self, work: Path):
        super().__init__(work)
        import transformers
        from safetensors.torch import save_file
        from torch import zeros

        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(work / "base")
        self.folder = work / "adapter"
        self.folder.mkdir()
        tensors = {}
        for i in range(2):
            for proj, out in (("q_proj", 32), ("v_proj", 16)):
                key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
                tensors[f"{key}.lora_A.weight"] = zeros(4, 32)
                tensors[f"{key}.lora_B.weight"] = zeros(out, 4)
        save_file(tensors, str(self.folder / "adapter_model.safetensors"))
        doc = {
            "peft_type": "LORA",
            "base_model_name_or_path": "../base",
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"],
            "rank_pattern": {"q_proj": 4},
            "alpha_pattern": {},
            "bias": "none",
            "modules_to_save": None,
            "layers_to_transform": None,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "task_type": "CAUSAL_LM",
        }
        self.seed = _dumps(doc)
        self.run(self.seed)  # transformers and peft imported before the clock starts

    def mutant(self, rng: random.Random) -> bytes:
        if rng.random() < 0.2:
            return mutate_bytes(self.seed, rng)
        return _dumps(mutate_json(json.loads(self.seed), rng))

    def run(self, data: bytes) -> None:
        import warnings

        from yafsdp_cli.sources import load_source

        (self.folder / "adapter_config.json").write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's advice on odd configs
            load_source(self.folder)


TARGETS: dict[str, type[Target]] = {
    t.name: t
    for t in (
        SafetensorsTarget,
        IndexTarget,
        FlatTarget,
        TorchFileTarget,
        DcpTarget,
        GpuProfileTarget,
    )
}
if all(importlib.util.find_spec(m) for m in ("peft", "transformers")):  # the peft extra
    TARGETS[PeftTarget.name] = PeftTarget


def fuzz(
    name: str, seconds: float, seed: int = 0, work: Path | None = None
) -> tuple[list[Crash], int]:
    """Run target ``name`` for ``seconds``: the crashes found (empty: none) and how
    many inputs were tried."""
    from yafsdp_cli.errors import YafsdpError

    own = work is None
    work = Path(tempfile.mkdtemp(prefix=f"yafsdp-fuzz-{name}-")) if own else work
    try:
        target = TARGETS[name](work)
        rng = random.Random(seed)
        crashes: list[Crash] = []
        deadline, runs = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            runs += 1
            data = target.mutant(rng)
            try:
                target.run(data)
            except YafsdpError:
                pass
            except Exception as exc:  # noqa: BLE001 - what we hunt
                crashes.append(Crash(name, f"{type(exc).__name__}: {exc}"[:300], data))
        return crashes, runs
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="per target")
    parser.add_argument("--target", choices=sorted(TARGETS), action="append")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    found = 0
    for name in args.target or sorted(TARGETS):
        crashes, runs = fuzz(name, args.seconds, args.seed)
        kinds = sorted({c.error.split(":")[0] for c in crashes})
        print(f"{name}: {runs} inputs in {args.seconds:g} s, {len(crashes)} crashes {kinds or ''}")
        for c in {c.error: c for c in crashes}.values():
            print(f"  {c.error}\n    input: {c.data[:400]!r}")
        found += len(crashes)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
