"""vLLM in fresh processes (tests/integrations only): start ``vllm_driver.py`` and read
its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache.cli.benchmarks.serve_server import stop_process_group

VLLM_DRIVER = Path(__file__).parent / "vllm_driver.py"


def run_vllm(*args: str, **env_vars: str) -> subprocess.Popen:
    """Start ``tests/integrations/vllm_driver.py ARGS`` (stdout and stderr in one pipe),
    with ``env_vars`` added to its environment."""
    return run_driver(VLLM_DRIVER, *args, **env_vars)


def run_driver(driver: Path, *args: str, **env_vars: str) -> subprocess.Popen:
    """:func:`run_vllm` with another driver script (e.g. ``vllm_hybrid_driver.py``)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", **env_vars)
    return subprocess.Popen(
        [sys.executable, str(driver), *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )


def vllm_result(proc: subprocess.Popen, timeout: int = 900) -> dict:
    """The driver's last JSON line, after it exited 0; its whole output under ``"log"``."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:  # its engine processes too, whether it ended or timed out
        stop_process_group(proc, timeout_s=10)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"vLLM driver failed:\n{out[-6000:]}"
    return {**json.loads(lines[-1]), "log": out}
