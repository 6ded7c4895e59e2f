#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks in one run of at most 6 minutes:
#   bench/gpu_suite.sh [OUTDIR] [--budget-s S]        (OUTDIR default: $OUT)
# Needs no virtualenv and installs nothing: the checkout is put on PYTHONPATH and the
# native extension is JIT-built. Without a GPU the CUDA tests skip, the benchmarks run
# small CPU variants, and the exit status is 0. What each step does and what it writes:
# bench/gpu_suite.py; how to read the results: docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# The project's .venv where there is one (CI, this project's machines), else python3.
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" bench/gpu_suite.py "$@"
