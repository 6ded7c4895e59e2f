"""vLLM's OpenAI-compatible server in a subprocess, for the tests that talk HTTP to it
(tests/integrations only): the documented command (``server_command`` of
examples/vllm_serve_chat.py), CPU backend, a free 127.0.0.1 port, a tiny random Llama
with a word-level tokenizer written next to it, and a standard-library client.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
from pathlib import Path

from hicache.cli.benchmarks.serve_server import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
VOCAB = 512  # tests/integrations/vllm_driver.py's model
SPECIAL = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":"]
OUT_TOKENS = 8
# The CPU backend's settings of tests/integrations/vllm_driver.py, as server flags.
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
            "--max-model-len", "512", "--num-gpu-blocks-override", "24", "--max-num-seqs", "4"]


def _example():
    spec = importlib.util.spec_from_file_location(
        "vllm_serve_chat", ROOT / "examples" / "vllm_serve_chat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


chat_example = _example()


def connector_config(extra: dict, role: str = "kv_both") -> dict:
    """``--kv-transfer-config`` of the connector with ``extra`` as its extra config."""
    return {**chat_example.CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def write_tokenizer(model: Path, max_len: int = 512) -> None:
    """A word-level tokenizer over the model's vocabulary ("w7".."w511" and a few
    special words) with a chat template, so the server can tokenize chats."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": max_len,
        "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}",
    }))


class Server:
    """One server process: ``transfer`` its ``--kv-transfer-config`` (None: vLLM alone),
    ``args`` its CPU settings, ``env`` added to its environment; its log in ``root``."""

    def __init__(self, root: Path, model: str, name: str, transfer: dict | None,
                 args: list[str] = CPU_ARGS, env: dict[str, str] | None = None):
        self.name = name
        self.port = chat_example.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"server-{name}.log"
        cmd = chat_example.server_command(model, self.port,
                                          [*args, "--seed", "0", "--served-model-name", "tiny"])
        i = cmd.index("--kv-transfer-config")
        if transfer is None:
            del cmd[i:i + 2]
        else:
            cmd[i + 1] = json.dumps(transfer)
        self.cmd = cmd
        # hicache's warnings in the log (hicache_warnings: why a hit did not happen)
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                    "VLLM_SERVER_DEV_MODE": "1", "HICACHE_LOG_LEVEL": "WARNING", **(env or {})}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=full_env, start_new_session=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def hicache_warnings(self, last: int = 20) -> str:
        """The last ``last`` lines of its log where hicache warns or fails (for a failed
        assertion's message: why a hit did not happen)."""
        # hicache/logs.py's format: "<time> <logger> <LEVEL>: <message>"
        record = re.compile(r" hicache(\.\w+)* (WARNING|ERROR|CRITICAL): ")
        lines = [line for line in self.log.read_text(errors="replace").splitlines()
                 if record.search(line)]
        return f"{self.name}'s hicache warnings:\n" + "\n".join(lines[-last:])

    def wait_ready(self, timeout: float) -> None:
        try:
            chat_example.wait_ready(self.url, self.proc, timeout)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None

    def completion(self, prompt: list[int], max_tokens: int = OUT_TOKENS, **fields) -> dict:
        """The whole response of a greedy token-id completion (``fields`` added)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **fields}
        return chat_example.post(f"{self.url}/v1/completions", body)

    def complete(self, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
        """Output token ids and cached prompt tokens of a completion."""
        out = self.completion(prompt, **({} if salt is None else {"cache_salt": salt}))
        assert out["usage"]["prompt_tokens"] == len(prompt)
        return out["choices"][0]["token_ids"], cached_tokens(out)

    def reset(self) -> None:
        chat_example.reset_prefix_cache(self.url)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        """Stop the server and every process it started (its engine core): none outlives
        the test."""
        stop_process_group(self.proc, timeout_s=30)


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"] or 0


def start_all(servers: list[Server], timeout: float = 600) -> None:
    """Wait until every server answers (they start concurrently); stop them all if one
    does not."""
    try:
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def hit_able(n: int) -> int:
    """Prompt tokens a cache can serve: whole blocks, leaving the last token to compute."""
    return (n - 1) // BLOCK * BLOCK


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIAL), VOCAB) for _ in range(n)]


def make_model(directory: Path, max_len: int = 512) -> Path:
    """The tests' tiny model (positions up to ``max_len``), with the tokenizer, in
    ``directory``."""
    from vllm_processes import run_vllm

    proc = run_vllm("make-model", str(directory), "--max-len", str(max_len))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    write_tokenizer(directory, max_len)
    return directory
