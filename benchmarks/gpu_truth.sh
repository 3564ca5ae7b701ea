#!/usr/bin/env bash
# The GPU truth checks, run once on a machine with a CUDA GPU, from the repo root:
#   bash benchmarks/gpu_truth.sh OUTDIR
# 1. predicted reserved memory against the real allocator (each case in its own process);
# 2. verify --device cuda on a sample model, pinned (deterministic algorithms, cuBLAS workspace);
# 3. predicted step time against the measured step (each case in its own process).
set -uo pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 420 python3 -m benchmarks.bench_reserved_cuda --out "$out/reserved.json" 2>&1 | tee "$out/reserved.log"
for w in 1; do
  timeout 90 python3 -c "import sys; from yafsdp_cli.cli import main; sys.argv[0]='yafsdp'; main()" \
    verify sample_models/llama.safetensors --model sample_models.models:llama --device cuda \
    --json > "$out/verify_cuda.json" 2> "$out/verify_cuda.err"
  echo "verify --device cuda: exit $?"; tail -3 "$out/verify_cuda.err"
done
timeout 300 python3 -m benchmarks.bench_step_time_cuda --out "$out/step_time.json" 2>&1 | tee "$out/step_time.log"
