#!/usr/bin/env bash
# Disaggregated serving on one GPU: `pdserve bench compare` of 1P+1D against 2 colocated workers,
# every worker on the same GPU, on a random-weight model of SmolLM2-135M's shape (bfloat16; weights do not
# change speed, and the packaged GGUF does not travel to the GPU machine). The lowest rate is the
# no-load TTFT of a 1,024-token prompt, both shapes side by side.
#   bash tools/gpu_cluster.sh OUT_DIR        (from tools/gpu_checks.sh's `cluster` stage)
set -eu
out=${1:?usage: gpu_cluster.sh OUT_DIR}
model=/tmp/pdserve-smollm2-random
[ -f "$model/config.json" ] || python3 -c "
import torch
from pathlib import Path
from benchmarks.hf_baselines import write_random_model
write_random_model('smollm2', Path('$model'), torch.bfloat16, 'cuda')"
runs=/tmp/pdserve-gpu-compare
rm -rf "$runs"
set +e
python3 -m pdserve.cli bench compare --shapes 1P+1D 2C --model "$model" --dtype bfloat16 --no-pin-cpus \
  --up-arg=--device=cuda --up-arg=--gpu-memory-utilization=0.2 --up-arg=--local-prefill-threshold=1 \
  --input-len 1024 --output-len 64 --num-prompts 16 --warmup 2 --rates 1,8 \
  --goodput ttft:200 tpot:20 --out-dir "$runs" --no-progress
rc=$?
set -e
ls -la "$runs" || true
mkdir -p "$out/compare"
for f in "$runs"/compare.json "$runs"/*.md; do [ -f "$f" ] && cp "$f" "$out/compare/"; done
# The per-request records and plots stay on the machine: $OUT takes 8 files.
exit $rc
