"""vLLM's OpenAI-compatible server for ``hicache bench serve`` and ``bench soak``:
started, watched, reset and stopped.

A :class:`Server` runs ``python -m vllm.entrypoints.openai.api_server`` (the form that
works for both of vLLM's builds; the CPU build's ``vllm`` script does not start) on a
free 127.0.0.1 port, its output in a log file, in a process group of its own so that
:meth:`Server.stop` ends the whole tree (API server, engine core, workers). The
server takes token-id prompts only (``--skip-tokenizer-init``: a random model has no
tokenizer, and the bench measures the engine, not detokenization), unless its spec
says ``tokenizer`` (a real model's chats, rendered by its template), and reports cached
tokens per request (``--enable-prompt-tokens-details``); ``VLLM_SERVER_DEV_MODE=1``
opens ``POST /reset_prefix_cache`` (with ``?reset_external=true`` the connector's host
tier too, and the third tier's epoch).

Also here: the resident memory of the server's process tree (:meth:`Server.rss_bytes`)
and its Prometheus samples (:func:`parse_metrics`), the figures a soak watches.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

CONNECTOR_MODULE = "hicache.integrations.vllm"


@dataclass(frozen=True)
class ServerSpec:
    """What one server runs: a model, vLLM's sizes, an optional connector."""

    name: str  # the configuration's name: the log file's and the report's
    model_dir: str
    block_size: int
    num_blocks: int  # vLLM's own KV cache (--num-gpu-blocks-override)
    max_model_len: int
    max_num_seqs: int
    kv_nbytes_per_token: int  # to size VLLM_CPU_KVCACHE_SPACE
    connector: dict | None = None  # kv_connector_extra_config; None: vLLM alone
    env: Mapping[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0
    served_model_name: str = "bench"
    extra_args: tuple[str, ...] = ()
    # Load the model's tokenizer and chat template (chat completions); else token ids only.
    tokenizer: bool = False

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_dir, "--served-model-name", self.served_model_name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
               "--enforce-eager", "--block-size", str(self.block_size),
               "--num-gpu-blocks-override", str(self.num_blocks),
               "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed),
               "--enable-prefix-caching",
               *(() if self.tokenizer else ("--skip-tokenizer-init",)),
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
               *self.extra_args]
        if self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(connector_config(self.connector))]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # The CPU backend sizes its KV allocation from this (GiB), before the block cap.
        kv_gib = -(-self.num_blocks * self.block_size * self.kv_nbytes_per_token // 2**30)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_gib)))
        # One core kept off the worker in every configuration, as `hicache bench vllm`
        # does: with a connector vLLM's CPU backend would otherwise reserve one only when
        # the machine has cores to spare, and the configurations would compute on
        # different cores (see hicache/cli/benchmarks/vllm.py).
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        return env


def connector_config(extra: dict) -> dict:
    """The ``--kv-transfer-config`` of hicache's connector with ``extra`` as its
    ``kv_connector_extra_config``; a failed load is recomputed (hicache's contract)."""
    return {"kv_connector": "HiCacheConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": extra,
            "kv_load_failure_policy": "recompute"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One running server; :meth:`stop` it (a ``with`` block does)."""

    def __init__(self, spec: ServerSpec, log_dir: str) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{spec.name}.server.log")
        self.started_s = time.monotonic()
        with open(self.log_path, "w") as log:
            # cwd=log_dir: a vllm.py in the caller's directory must not shadow vLLM.
            self.proc = subprocess.Popen(spec.command(self.port), stdout=log,
                                         stderr=subprocess.STDOUT, cwd=log_dir,
                                         env=spec.environment(), start_new_session=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, num_lines: int = 25) -> str:
        with open(self.log_path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-num_lines:])

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers; seconds since the start. Raises
        RuntimeError (with the log's tail) if the server exits or takes too long."""
        deadline = self.started_s + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.spec.name} exited with {self.proc.returncode} "
                                   f"before it was ready; last lines of its log:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started_s
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server {self.spec.name} was not ready within {timeout_s:.0f} s; "
                           f"last lines of its log:\n{self.tail()}")

    def rss_bytes(self) -> int:
        return sum(tree_rss(self.proc.pid).values())

    def stop(self, timeout_s: float = 60.0) -> None:
        stop_process_group(self.proc, timeout_s)


def tree_rss(pid: int) -> dict[str, int]:
    """Resident memory of process ``pid`` and of each of its descendants, by
    ``"name:pid"`` (shared pages counted in each process); empty if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            out[f"{p.name()}:{p.pid}"] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def post_json(url: str, path: str, timeout_s: float = 60.0) -> dict:
    req = urllib.request.Request(f"{url}{path}", data=b"{}",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read() or b"{}")


def reset_caches(url: str, with_connector: bool) -> None:
    """Empty vLLM's prefix cache and, ``with_connector``, the connector's host tier (and
    the third tier's epoch moves on: nothing stored before hits). vLLM refuses while
    blocks are still held (a save in flight): retried for up to ~10 s."""
    path = "/reset_prefix_cache" + ("?reset_external=true" if with_connector else "")
    for _ in range(100):
        if post_json(url, path).get("success", True):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: POST {path} kept answering success=false")


def get_metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{series: value}`` (see :func:`parse_metrics`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def served_model(url: str) -> str:
    """The first model name ``/v1/models`` lists."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format to ``{"name{labels}": value}``, labels without
    ``model_name`` and ``engine`` (one server, one model); a series without other labels
    is keyed by its bare name. Comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name, brace, labels = name_labels.partition("{")
        kept = []
        if brace:
            for item in labels.rstrip("}").split(","):
                key = item.partition("=")[0].strip()
                if item.strip() and key not in ("model_name", "engine"):
                    kept.append(item.strip())
        key = f"{name}{{{','.join(kept)}}}" if kept else name
        out[key] = out.get(key, 0.0) + number
    return out


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop ``proc``, started with ``start_new_session=True`` (a vLLM server, whose engine
    core and workers are its children): SIGINT (vLLM's own shutdown), then SIGKILL to
    what is left of its process group, so that no engine process outlives it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, a CI job cancelled) raises ``KeyboardInterrupt`` in the main
    thread, as Ctrl-C does: the ``finally`` blocks stop every server, whose process
    groups no signal to this process reaches (``hicache bench serve``, ``soak``, ``pd``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
