#!/usr/bin/env bash
# Installs what tests/storage/test_mooncake.py needs into an existing .venv (run `make install`
# first): the system libraries the CPU Mooncake wheel links against, then the project's
# optional `mooncake` extra. Torch must come out of it unchanged (the extra pulls no torch;
# this checks it). Idempotent: already-present packages are not reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "install_mooncake: $PY not found; run 'make install' first" >&2
    exit 1
fi

missing=()
for pkg in libibverbs1 librdmacm1 libnuma1; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_mooncake: need ${missing[*]} but apt-get is not available" >&2
        exit 1
    fi
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
"$PY" -m pip install -q $("$PY" .ci/extra_requirements.py mooncake)
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
    echo "install_mooncake: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi

# Fail here, with the loader's message, rather than as skipped tests later.
"$PY" -c 'import mooncake.store'
"$PY" -c 'from hicache.testing.mooncake_master import mooncake_binary as b; b("mooncake_master"); b("mooncake_client")'
echo "install_mooncake: mooncake extra ready (torch $torch_after)"
