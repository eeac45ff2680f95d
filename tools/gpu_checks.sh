#!/usr/bin/env bash
# The GPU checks of the CUDA engine and the GPU KV transfer, in one device-machine call.
#
#   ../shared/device/fetch-wheels.sh all          # here, once: .whl/ (ignored by git)
#   python tools/trim_ucx_wheel.py                # here: the tree + .whl/ must fit the tool's 64 MiB
#   bash tools/gpu_checks.sh [STAGE ...]          # there, from the project root (device tool: OUT is set)
#
# Stages (default: env tests engine): env, tests, micro, engine, engine-full, profile, kv, kvipc, kvtests,
# cluster. Each runs under its own
# time limit, never past DEADLINE_S seconds from the start (default 540), and writes $OUT/<stage>.log;
# a stage that fails or times out does not stop the next. The engine benchmark logs each row as it
# finishes, so a row measured before a time limit is in the log even when the JSON is not written.
set -u
OUT=${OUT:-/tmp/pdserve-gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-540}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env tests engine)

# shellcheck disable=SC1091
source .whl/setup.sh || { echo "setup.sh failed"; exit 1; }
export PDSERVE_TEST_THREADS=4

run_stage() {  # name, limit seconds, command...
  local name=$1 limit=$2 left
  STAGE_RC=skipped
  shift 2
  left=$((DEADLINE_S - ($(date +%s) - START) - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then echo "== $name: skipped, no time left"; return; fi
  echo "== $name (limit ${limit}s) at +$(($(date +%s) - START))s"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  STAGE_RC=$?
  echo "== $name rc=$STAGE_RC at +$(($(date +%s) - START))s"
}

# With PDSERVE_GEMV_FUSE_NORMS=1 (the batch-1 gemvs taking the RMSNorms and residual adds; off by
# default): where the GPU tests show them failing, the stages after run with them off and say so.
fused_norms_failed() {  # log
  grep -E "^(FAILED|ERROR) .*(batch_one|gemv|fused)" "$1" >/dev/null 2>&1 ||
    grep -E "_gemv_kernel|CompilationError" "$1" >/dev/null 2>&1
}
fuse_off() {  # why
  if [ "${PDSERVE_GEMV_FUSE_NORMS:-0}" = 1 ]; then
    export PDSERVE_GEMV_FUSE_NORMS=0
    echo "== fused-norm gemvs OFF from here on: $1"
  fi
}

for stage in "${STAGES[@]}"; do
  case $stage in
  env)
    run_stage env 60 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv;
      lscpu | grep -E "^(Model name|CPU\(s\)|CPU max MHz)";
      python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())";
      python3 -c "import torch; torch.cuda.init(); import ucxx; print(\"ucxx\", ucxx.__version__, ucxx.get_ucx_version())";
      python3 -c "import pdserve.engine, pdserve.kv_transfer.transports.ucp_rma as r; print(\"pdserve ok\")"; gcc --version | head -1'
    cat "$OUT/env.log"
    ;;
  tests)
    # The kernels compiled (not interpreted), the CUDA backend and both parity suites on the GPU.
    run_stage tests 150 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 180 -rfE \
      tests/unit/test_triton_kernels.py tests/unit/test_cuda_backend.py tests/e2e/test_cuda_backend_cluster.py \
      tests/unit/test_sampler.py tests/e2e/test_kv_transfer_cuda.py tests/e2e/test_tensor_parallel_gpu.py \
      "tests/unit/test_model_parity.py" -k "triton or gpu or cuda"
    tail -n 60 "$OUT/tests.log"
    fused_norms_failed "$OUT/tests.log" && fuse_off "a batch-1 / gemv GPU test failed"
    ;;
  engine)
    # The GPU targets' rows (batch 1, 32, 256; 1,024-token prefill) with both transformers baselines.
    run_stage engine 300 python3 -m benchmarks.engine --device cuda --random-model smollm2 \
      --batches 1,32,256 --reps 2 --out "$OUT/engine_cuda.json"
    tail -n 40 "$OUT/engine.log"
    if [ "$STAGE_RC" != 0 ] && [ "${PDSERVE_GEMV_FUSE_NORMS:-0}" = 1 ] && fused_norms_failed "$OUT/engine.log"; then
      fuse_off "the engine benchmark failed in a gemv"
      mv "$OUT/engine.log" "$OUT/engine_fused_failed.log"
      run_stage engine 300 python3 -m benchmarks.engine --device cuda --random-model smollm2 \
        --batches 1,32,256 --reps 2 --out "$OUT/engine_cuda.json"
      tail -n 40 "$OUT/engine.log"
    fi
    ;;
  engine-full)
    run_stage engine-full 420 python3 -m benchmarks.engine --device cuda --random-model smollm2 \
      --out "$OUT/engine_cuda_full.json"
    tail -n 40 "$OUT/engine-full.log"
    ;;
  kv)
    run_stage kv 150 python3 -m benchmarks.kv_transfer --device cuda --transports cuda,cuda_ipc \
      --modes rma --tokens 256,1024,4096 --reps 5 --out "$OUT/kv_cuda.json"
    tail -n 40 "$OUT/kv.log"
    ;;
  micro)
    run_stage micro 200 python3 -m tools.gpu_micro --out "$OUT/micro.json"
    tail -n 80 "$OUT/micro.log"
    ;;
  profile)
    run_stage profile 120 python3 -m tools.gpu_profile --batches 1,32,256
    tail -n 20 "$OUT/profile.log"
    ;;
  kvipc)
    # The one-host CUDA IPC rows alone (the transfer's acceptance rows).
    run_stage kvipc 90 python3 -m benchmarks.kv_transfer --device cuda --transports cuda_ipc \
      --modes rma --tokens 256,1024,4096 --reps 5 --out "$OUT/kv_cuda_ipc.json"
    tail -n 40 "$OUT/kvipc.log"
    # Every layer in one push (a prefill under CUDA graphs, 2,048 tokens and fewer): one 2D copy per run.
    run_stage kvipc_burst 90 python3 -m benchmarks.kv_transfer --device cuda --transports cuda_ipc \
      --modes rma --tokens 256,1024,4096 --reps 5 --burst 30 --out "$OUT/kv_cuda_ipc_burst.json"
    tail -n 40 "$OUT/kvipc_burst.log"
    ;;
  kvtests)
    run_stage kvtests 90 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 80 -rfE tests/e2e/test_kv_transfer_cuda.py
    tail -n 30 "$OUT/kvtests.log"
    ;;
  cluster)
    run_stage cluster 240 bash tools/gpu_cluster.sh "$OUT"
    tail -n 60 "$OUT/cluster.log"
    ;;
  *) echo "unknown stage $stage" ;;
  esac
done
echo "== done at +$(($(date +%s) - START))s"
# The device tool brings back at most 8 files: everything in one archive (GPU_CHECKS_PACK=0 leaves them).
if [ "${GPU_CHECKS_PACK:-1}" != 0 ]; then
  (cd "$OUT" && tar czf /tmp/gpu_checks.tgz --exclude gpu_checks.tgz . && rm -rf ./* && mv /tmp/gpu_checks.tgz .)
  ls -la "$OUT"
fi
