"""The one run a lent GPU machine gets: CUDA tests, then the GPU benchmarks, in a budget.

    python3 bench/gpu_suite.py [OUTDIR] [--budget-s 360]     (OUTDIR default: $OUT)

Made for a machine with Python, torch (a CUDA build), a C++ compiler, ninja, pytest
and hypothesis, and nothing else: no virtualenv, no vLLM, no network. Nothing is
installed. The project is imported from this checkout (``PYTHONPATH``), and its
native extension is JIT-built here first; if that fails, one line says why and
every later step runs with the Python tree (``HICACHE_NATIVE=prebuilt``: no second
build attempt).

Steps, in order, each in its own process group with its own timeout, all inside
one wall-clock budget (``--budget-s``): a step's timeout is cut to what is left,
and a step that cannot get ``min_s`` seconds is skipped and says so::

    env          python, torch, CUDA, GPU, driver, nvcc, ninja (into summary.json)
    native       the C++ extension (radix tree, lifecycle) and the C row copier
    cuda_tests   pytest -m cuda tests  (CUDA executor, CUDA races, connector on CUDA)
    vllm_e2e     the connector inside real vLLM on the GPU (only where vLLM imports)
    vllm_hybrid  the connector on a linear-attention hybrid (Qwen3-Next, Mamba "align"
                 mode state groups) inside real vLLM on the GPU (only where vLLM imports)
    transfer     hicache bench transfer: pinned pages vs a contiguous cudaMemcpyAsync
    recompute    hicache bench recompute: two layers of Llama-3-8B, prefill vs reload
    multiturn    hicache bench multiturn on the GPU
    vllm_bench   vLLM alone vs with the connector (only where vLLM imports)

Without a GPU every CUDA test skips, the benchmarks run a small CPU variant (the
same code, so the suite itself is tested; their figures mean nothing) or skip with
a line, and the exit status is 0 (CI runs it so). With one, the exit status is 1
if any step failed or timed out.

Output, written as the steps go (a killed run leaves what was done): ``summary.json``
(the environment, then per step its command, exit status, seconds, whether it timed
out, the last lines of its output, and a benchmark's JSON result), ``suite.log``
(every step's whole output, under a header line) and ``cuda_tests.xml`` (JUnit).
Three files, whatever the number of steps. docs/gpu.md says how to read them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 360.0  # the 6 minutes, start to last byte written
_RESERVE_S = 5.0  # kept back from every step for writing the summary
_TAIL_LINES = 40  # of each step's output, copied into summary.json

_ENV_SCRIPT = r"""
import json, os, platform, shutil, subprocess, sys
import torch
def first_line(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        lines = [l for l in (out.stdout + out.stderr).splitlines() if l.strip()]
        return lines[-1].strip() if lines else f"exit {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({type(exc).__name__})"
info = {
    "python": sys.version.split()[0], "executable": sys.executable,
    "platform": platform.platform(), "cpus": os.cpu_count(),
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "nvcc": first_line(["nvcc", "--version"]) if shutil.which("nvcc") else None,
    "ninja": first_line(["ninja", "--version"]) if shutil.which("ninja") else None,
    "cxx": shutil.which(os.environ.get("CXX", "c++")),
}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_count=torch.cuda.device_count(),
                capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                multiprocessors=p.multi_processor_count)
    if shutil.which("nvidia-smi"):
        info["driver"] = first_line(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.max,"
                                     "pcie.link.width.max", "--format=csv,noheader"])
import hicache
info["hicache"] = hicache.__file__
print(json.dumps(info))
"""

_NATIVE_SCRIPT = r"""
from hicache.native import build
from hicache.memory import load_native_copier
print("native extension:", build.native_status())
print("row copier:", "built" if load_native_copier() is not None else "unavailable")
if not build.native_available():
    raise SystemExit(3)
"""


@dataclass
class Step:
    """One command of the suite."""

    name: str
    argv: list[str]
    timeout_s: float
    min_s: float = 10.0  # skipped when less than this is left of the budget
    bench: bool = False  # the last stdout line is the benchmark's JSON result
    ok_codes: tuple[int, ...] = (0,)
    fatal: bool = True  # a failure or timeout makes the suite's exit status 1
    result: dict = field(default_factory=dict)


class Suite:
    """Runs steps against one deadline, writing the log and the summary as it goes."""

    def __init__(self, out: Path, budget_s: float, python: str) -> None:
        self.out = out
        self.python = python
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.summary: dict = {"budget_s": budget_s, "python": python, "steps": []}
        self.log = open(out / "suite.log", "a", buffering=1)  # noqa: SIM115 - the run's log
        self.env = dict(os.environ)
        # The checkout first on the path: no install, no virtualenv needed.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.failed = False

    def close(self) -> None:
        self.write_summary()
        self.log.close()

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")

    def write_summary(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n")
        tmp.replace(self.out / "summary.json")

    def skip(self, name: str, reason: str) -> None:
        self.say(f"== {name}: skipped ({reason})")
        self.summary["steps"].append({"name": name, "status": "skipped", "reason": reason})
        self.write_summary()

    def run(self, step: Step) -> dict:
        left = self.deadline - time.monotonic() - _RESERVE_S
        if left < step.min_s:
            self.skip(step.name, f"budget spent: {max(left, 0):.0f} s left, needs {step.min_s:.0f}")
            return {"status": "skipped"}
        limit = min(step.timeout_s, left)
        cmd = [self.python if a == "PY" else a for a in step.argv]
        # An inline script (-c) is shown by name: its text is in this file.
        shown = [f"<{step.name} script>" if i and cmd[i - 1] == "-c" else a
                 for i, a in enumerate(cmd)]
        self.say(f"== {step.name} (timeout {limit:.0f} s): {' '.join(shown)}")
        lines: list[str] = []
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                self.log.write(line + "\n")
                print(line, flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.wait()
        reader.join(timeout=5)
        proc.stdout.close()
        seconds = time.monotonic() - started
        record = {"name": step.name, "command": shown, "rc": rc, "seconds": round(seconds, 1),
                  "timed_out": timed_out, "tail": lines[-_TAIL_LINES:]}
        ok = not timed_out and rc in step.ok_codes
        if step.bench and ok:
            try:
                record["result"] = json.loads(lines[-1])
            except (IndexError, ValueError):
                ok = False
                record["error"] = "the last output line is not a JSON object"
        record["status"] = "ok" if ok else ("timeout" if timed_out else "failed")
        if not ok and step.fatal:
            self.failed = True
        self.say(f"== {step.name}: {record['status']} (exit {rc}, {seconds:.1f} s)")
        self.summary["steps"].append(record)
        self.write_summary()
        return record


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the step and everything it started (its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _module(name: str, *args: str) -> list[str]:
    return ["PY", "-m", f"hicache.cli.benchmarks.{name}", "--json", *args]


def _has_vllm(suite: Suite) -> bool:
    try:
        probe = subprocess.run([suite.python, "-c", "import vllm"], cwd=ROOT, env=suite.env,
                               capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT"),
                        help="output folder (default: $OUT)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall-clock budget of the whole run (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter every step runs with (default: this one)")
    args = parser.parse_args(argv)
    if not args.out:
        print("gpu_suite: expected an output folder (argument or $OUT), got none", file=sys.stderr)
        return 2
    if args.budget_s <= 0:
        print(f"gpu_suite: --budget-s: expected > 0, got {args.budget_s}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = Suite(out, args.budget_s, args.python)

    env = suite.run(Step("env", ["PY", "-c", _ENV_SCRIPT], 90, min_s=1, bench=True))
    info = env.get("result", {})
    suite.summary["env"] = info
    gpu = bool(info.get("cuda_available"))
    suite.summary["gpu"] = gpu
    if env.get("status") != "ok":
        suite.say(f"gpu_suite: the env step {env.get('status')} (does torch import here?); "
                  "nothing else can run")
        suite.close()
        return 1

    # Not fatal: without the extension every step runs on the Python tree.
    native = suite.run(Step("native", ["PY", "-c", _NATIVE_SCRIPT], 180, min_s=30, fatal=False))
    if native.get("status") != "ok":
        reason = next((line.removeprefix("native extension: ")
                       for line in reversed(native.get("tail", []))
                       if line.startswith("native extension:")), native.get("status"))
        suite.say(f"native extension unavailable ({reason}): the rest runs with the Python tree")
        suite.env["HICACHE_NATIVE"] = "prebuilt"  # no second build attempt in later steps
    suite.summary["native"] = native.get("status")

    # 5: nothing collected. Without a GPU every CUDA test is skipped: exit 0.
    # A test module that fails to import here (a missing optional package) is reported
    # and fails the step, but does not stop the CUDA tests of the other modules.
    suite.run(Step("cuda_tests", ["PY", "-m", "pytest", "-q", "-m", "cuda", "-p",
                                  "no:cacheprovider", "-rs", "--continue-on-collection-errors",
                                  f"--junitxml={out / 'cuda_tests.xml'}", "tests"],
                   150, min_s=30, ok_codes=(0, 5)))

    vllm = gpu and _has_vllm(suite)
    if vllm:
        suite.run(Step("vllm_e2e", ["PY", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "tests/integrations/test_vllm_connector_e2e.py"], 240, min_s=120))
    else:
        suite.skip("vllm_e2e", "no GPU" if not gpu else "vLLM does not import here")
    if vllm:
        suite.run(Step("vllm_hybrid", ["PY", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       "-m", "slow", "-k", "linear_attention",
                                       "tests/integrations/test_vllm_hybrid_e2e.py"],
                       240, min_s=120))
    else:
        suite.skip("vllm_hybrid", "no GPU" if not gpu else "vLLM does not import here")

    if gpu:
        suite.run(Step("transfer", _module("transfer", "--device", "cuda", "--total-mib", "256",
                                           "--modes", "load", "backup", "both"), 75, bench=True))
        suite.run(Step("recompute", _module(
            "recompute", "--device", "cuda", "--executor", "cuda", "--preset",
            "llama3-8b-layers2", "--dtype", "bfloat16", "--tokens", "512,1024,2048,4096,8192"),
            75, bench=True))
        suite.run(Step("multiturn", _module("multiturn", "--device", "cuda"), 60, bench=True))
    else:
        # The same code on the CPU, small: proves the steps and their JSON, measures nothing.
        suite.say("no CUDA device: GPU benchmarks run as small CPU variants (figures not results)")
        suite.run(Step("transfer", _module("transfer", "--device", "cpu", "--page-kib", "16",
                                           "1024", "--total-mib", "16", "--repeats", "3",
                                           "--modes", "load", "backup", "both"), 60, bench=True))
        suite.run(Step("recompute", _module("recompute", "--device", "cpu", "--preset", "tiny",
                                            "--tokens", "64,128", "--repeats", "1",
                                            "--reload-repeats", "3"), 60, bench=True))
        suite.skip("multiturn", "no GPU (its CPU figures are in docs/benchmarks.md)")
    if vllm:
        # bfloat16: FlashAttention has no float32 kernels.
        suite.run(Step("vllm_bench", _module("vllm", "--workload", "agentic", "--preset", "medium",
                                             "--dtype", "bfloat16", "--concurrency", "8"), 240,
                       min_s=120, bench=True))
    else:
        suite.skip("vllm_bench", "no GPU" if not gpu else "vLLM does not import here")

    status = "failed" if suite.failed else "ok"
    suite.summary["status"] = status
    suite.say(f"gpu_suite: {status} in {time.monotonic() - suite.start:.0f} s; "
              f"results in {out}/summary.json")
    suite.close()
    return 1 if suite.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
