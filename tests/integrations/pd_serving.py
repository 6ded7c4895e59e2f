"""Prefill/decode disaggregation over HTTP, for the tests (tests/integrations only): a
prefill and a decode server (``vllm_servers.Server``) sharing one third tier, and the
proxy between them.

:class:`Proxy` does what vLLM's toy disaggregation proxy does with a completion (its
copy ships in the Mooncake package, ``mooncake/vllm_v1_proxy_server.py``): the request
goes to the prefill instance with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true, ...}``, then, with whatever ``kv_transfer_params`` the
prefill's answer carries, to the decode instance, whose answer is the client's. The
proxy here runs in the test's own process (a thread) and keeps each prefill answer's
params, so a test can read what was handed off.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_servers import BLOCK, CPU_ARGS, chat_example

# What the toy proxy puts in a prefill request
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None,
                 "remote_host": None, "remote_port": None}
# The servers' CPU settings, for prompts of up to 700 tokens
PD_ARGS = [*CPU_ARGS[:CPU_ARGS.index("--max-model-len")], "--max-model-len", "1024",
           "--num-gpu-blocks-override", "48", "--max-num-seqs", "4"]
REFERENCE = {"hicache": {"skip_load": True, "skip_save": True}}  # vLLM computes alone
PROMPT_LENGTHS = (300, 420, 530, 610, 700, 356)  # the six prompts: 300-700 tokens


class Proxy:
    """The toy proxy's protocol for ``/v1/completions``, in a thread on a free port."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.handed_off: list[dict | None] = []  # each prefill answer's kv_transfer_params
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = proxy.forward(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def forward(self, path: str, body: dict) -> dict:
        prefill = {**body, "kv_transfer_params": dict(REMOTE_DECODE), "max_tokens": 1,
                   "stream": False}
        answer = chat_example.post(self.prefill_url + path, prefill)
        params = answer.get("kv_transfer_params")
        self.handed_off.append(params)
        if params:
            body = {**body, "kv_transfer_params": params}
        return chat_example.post(self.decode_url + path, body)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def whole_pages(n: int) -> int:
    """Whole pages of an ``n``-token prompt (what a prefill instance stores)."""
    return n // BLOCK


def own_cores() -> tuple[dict[str, str], dict[str, str]]:
    """The prefill's and the decode's environment: each binds its model runner to a core
    of its own, as instances sharing a machine are deployed (docs/vllm.md), as
    ``hicache bench pd`` does (``server_cores``)."""
    from hicache.cli.benchmarks.pd import server_cores

    prefill, decode = server_cores()
    return _bind(prefill), _bind(decode)


def own_copies() -> dict[str, object]:
    """Both servers' copy settings (``kv_connector_extra_config``): their copy threads
    off either server's model-runner core (``hicache bench pd``'s ``server_copies``)."""
    from hicache.cli.benchmarks.pd import server_copies, server_cores

    return server_copies(server_cores())


def _bind(core: int | None) -> dict[str, str]:
    return {} if core is None else {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
