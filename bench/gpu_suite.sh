#!/usr/bin/env bash
# Run the CUDA tests and the GPU benchmarks in one go; JSON results land in OUTDIR.
#   bench/gpu_suite.sh OUTDIR
# Without a GPU the CUDA tests skip and the benchmarks are not run; the script exits 0.
# Add a benchmark: one `bench NAME TIMEOUT_S ARGS...` line below, NAME a module of
# hicache.cli.benchmarks (its last stdout line,
# one JSON object, is written to OUTDIR/NAME.json).
set -uo pipefail
OUT=${1:?usage: bench/gpu_suite.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
status=0

has_gpu=$($PY -c 'import torch; print(int(torch.cuda.is_available()))')
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' | tee "$OUT/env.txt"

# CUDA tests (skip cleanly without a GPU).
timeout 150 $PY -m pytest -q -m cuda -p no:cacheprovider \
  --junitxml="$OUT/cuda_tests.xml" tests 2>&1 | tee "$OUT/cuda_tests.txt"
rc=${PIPESTATUS[0]}
# 5: no tests collected (fine on a tree without CUDA tests)
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi

bench() {  # bench NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  echo "== bench $name"
  if timeout "$limit" $PY -m "hicache.cli.benchmarks.$name" "$@" > "$OUT/$name.txt" 2>&1; then
    tail -n 1 "$OUT/$name.txt" > "$OUT/$name.json"
    cat "$OUT/$name.txt"
  else
    echo "bench $name failed (exit $?); see $OUT/$name.txt"; tail -n 20 "$OUT/$name.txt"
    status=1
  fi
}

# The vLLM connector end to end on the GPU (CUDA executor, layer-by-layer loads): same
# outputs with and without it, more tokens cached, host tier after a reset, file tier
# across processes. Needs vLLM's CUDA build (`pip install vllm`); skipped without it.
if [ "$has_gpu" = 1 ]; then
  echo "== vllm connector (tests/integrations/test_vllm_connector_e2e.py)"
  timeout 900 $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/vllm_connector.xml" \
    tests/integrations/test_vllm_connector_e2e.py 2>&1 | tee "$OUT/vllm_connector.txt"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi
fi

if [ "$has_gpu" = 1 ]; then
  bench transfer 90 --device cuda --total-mib 512
  bench recompute 90 --device cuda --preset llama3-8b-layers2 --tokens 1024,2048,4096,8192
  bench multiturn 90 --device cuda
  # vLLM (CUDA build: pip install vllm) alone vs with the hicache connector; three engine
  # starts. bfloat16: FlashAttention has no float32 kernels.
  if $PY -c 'import vllm' 2>/dev/null; then
    bench vllm 540 --workload agentic --preset medium --dtype bfloat16 --concurrency 8
  else
    echo "vLLM not installed: bench vllm skipped"
  fi
else
  echo "no CUDA device: GPU benchmarks skipped"
fi
exit $status
