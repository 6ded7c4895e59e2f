"""Runs one vLLM engine (CPU backend) over a fixed workload and prints one JSON line.

Used by tests/integrations/test_vllm_connector_e2e.py in a subprocess: vLLM spawns processes,
so it must run under ``if __name__ == "__main__"``. Usage::

    python tests/integrations/vllm_driver.py make-model DIR [--max-len N]
    python tests/integrations/vllm_driver.py make-adapter DIR
    python tests/integrations/vllm_driver.py run DIR SCENARIO[,SCENARIO...] [--storage file:DIR] [--no-connector] [--policy recompute|fail] [--host-tokens N] [--tp N] [--write-policy P] [--extra JSON] [--lora DIR]

SCENARIO is a comma-separated list run in order on one engine: ``multiturn``
(conversations whose working set is several times vLLM's KV cache, one request at a
time), ``fixed`` (the same shape, but each turn's history grows by fixed tokens, not by
the model's output: every run sends the same prompts, whatever fails), ``reset`` (a
prompt, reset_prefix_cache, the same prompt again), ``salt`` (a prompt under one
``cache_salt``, reset_prefix_cache, the same tokens under another salt, then under the
first again), ``replay`` (the first prompt of ``multiturn``: meant for a second process
on the same storage), ``lora`` (two prompts, each under the ``--lora`` adapter and
without it, vLLM's cache emptied before each: the engine has LoRA and prompt embeddings
on), ``embeds`` (a prompt of embeddings, another one, the first again, emptied before
each). ``--policy`` sets ``kv_load_failure_policy``; ``HICACHE_FAULTS``
in the environment makes the connector's worker fail some copies (see
hicache/integrations/vllm/worker/faults.py). ``--extra`` adds fields to the connector's
``kv_connector_extra_config`` (e.g. ``{"prefetch_threshold_tokens": 0}``).
The last stdout line is a JSON object with one entry per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_GPU_BLOCKS = 24  # 768 tokens of vLLM KV: must hold one max_model_len sequence
VOCAB = 512
CONVERSATIONS = 8
TURNS = 3
SYSTEM_TOKENS = 96  # shared by every conversation
USER_TOKENS = 64
OUTPUT_TOKENS = 16


def make_model(path: str, max_len: int = MAX_MODEL_LEN) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=max_len, initializer_range=0.2, tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def make_adapter(path: str) -> None:
    """A rank-8 LoRA adapter on q/k/v/o of :func:`make_model`'s model, in PEFT's files
    (``adapter_config.json``, ``adapter_model.safetensors``), large enough to change the
    greedy outputs."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(5)
    rank, hidden, q, kv = 8, 128, 4 * 32, 2 * 32  # (out, in) of each projection below
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q)}
    weights = {}
    for layer in range(2):
        for name, (out, inp) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": list(shapes),
                   "fan_in_fan_out": False}, f)


def conversations() -> list[list[list[int]]]:
    """Per conversation, per turn: the user tokens (deterministic)."""
    import random

    rng = random.Random(1)
    return [[[rng.randrange(1, VOCAB) for _ in range(USER_TOKENS)] for _ in range(TURNS)]
            for _ in range(CONVERSATIONS)]


def system_prompt() -> list[int]:
    import random

    rng = random.Random(2)
    return [rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS)]


def make_llm(model: str, connector: bool, storage: str | None, policy: str | None = None,
             host_tokens: int = 8192, tp: int = 1, write_policy: str | None = None,
             extra_fields: dict | None = None, inputs: bool = False):
    from vllm import LLM

    kwargs: dict = {}
    if inputs:  # LoRA adapters and prompts of embeddings
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1, enable_prompt_embeds=True)
    if connector:
        extra: dict = {"host_tokens": host_tokens}
        if write_policy:
            extra["write_policy"] = write_policy
        if storage:
            extra["storage"] = storage
        extra.update(extra_fields or {})
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiCacheConnector",
            "kv_connector_module_path": "hicache.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if policy:
            kwargs["kv_transfer_config"]["kv_load_failure_policy"] = policy
    return LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_GPU_BLOCKS,
        gpu_memory_utilization=0.1, max_num_seqs=4, seed=0, tensor_parallel_size=tp, **kwargs,
    )


def generate(llm, prompt: list[int], cache_salt: str | None = None) -> tuple[list[int], int]:
    out = _generate(llm, prompt, cache_salt)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _generate(llm, prompt: list[int], cache_salt: str | None = None,
              hicache: dict | None = None):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True,
                            extra_args=None if hicache is None
                            else {"kv_transfer_params": {"hicache": hicache}})
    inputs = TokensPrompt(prompt_token_ids=prompt)
    if cache_salt is not None:
        inputs["cache_salt"] = cache_salt
    return llm.generate([inputs], params, use_tqdm=False)[0]


def _after_reset(llm, prompt, lora=None) -> tuple[list[int], int]:
    """Greedy output and cached tokens of ``prompt`` (token ids, or a tensor of
    embeddings) after emptying vLLM's own prefix cache (hicache keeps its tiers)."""
    from vllm import SamplingParams

    assert llm.reset_prefix_cache()
    inputs = ({"prompt_token_ids": prompt} if isinstance(prompt, list)
              else {"prompt_embeds": prompt})
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    out = llm.generate([inputs], params, lora_request=lora, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def run(model: str, scenarios: str, connector: bool, storage: str | None,
        policy: str | None = None, host_tokens: int = 8192, tp: int = 1,
        write_policy: str | None = None, extra_fields: dict | None = None,
        lora: str | None = None) -> dict:
    """Run the comma-separated ``scenarios`` in order on one engine."""
    llm = make_llm(model, connector, storage, policy, host_tokens, tp, write_policy,
                   extra_fields, inputs=lora is not None)
    result: dict = {"connector": connector}
    system = system_prompt()
    for scenario in scenarios.split(","):
        if scenario == "multiturn":
            history = [list(system) for _ in range(CONVERSATIONS)]
            outputs, cached, prompt_tokens, hits, prompts = [], 0, 0, [], []
            for turn in range(TURNS):
                for c, conv in enumerate(conversations()):
                    history[c] += conv[turn]
                    prompts.append(list(history[c]))
                    out, hit = generate(llm, history[c])
                    prompt_tokens += len(history[c])
                    history[c] += out
                    outputs.append(out)
                    cached += hit
                    hits.append(hit)
            result["multiturn"] = {
                "outputs": outputs, "cached_tokens": cached, "prompt_tokens": prompt_tokens,
                "cached_per_request": hits, "prompts": prompts,
            }
        elif scenario == "reset":
            prompt = system + conversations()[1][0]
            first, hit0 = generate(llm, prompt)
            ok = llm.reset_prefix_cache()
            second, hit1 = generate(llm, prompt)
            result["reset"] = {
                "first": first, "second": second, "cached_before": hit0, "cached_after": hit1,
                "reset_ok": bool(ok), "prompt_tokens": len(prompt),
            }
        elif scenario == "fixed":
            filler = conversations()  # fixed "assistant" tokens instead of the outputs
            history = [list(system) for _ in range(CONVERSATIONS)]
            outputs, finish = [], []
            for turn in range(TURNS):
                for c, conv in enumerate(conversations()):
                    history[c] += conv[turn]
                    try:
                        out = _generate(llm, history[c])
                        outputs.append(list(out.outputs[0].token_ids))
                        finish.append(str(out.outputs[0].finish_reason))
                    except Exception as exc:  # noqa: BLE001 - a failed request is data here
                        outputs.append([])
                        finish.append(f"exception: {type(exc).__name__}")
                    history[c] += filler[(c + 1) % CONVERSATIONS][turn][:OUTPUT_TOKENS]
            result["fixed"] = {"outputs": outputs, "finish": finish}
        elif scenario == "salt":
            prompt = system + conversations()[2][0]
            first, hit_a = generate(llm, prompt, "tenant-a")
            llm.reset_prefix_cache()
            other, hit_b = generate(llm, prompt, "tenant-b")
            llm.reset_prefix_cache()
            again, hit_a2 = generate(llm, prompt, "tenant-a")
            result["salt"] = {"outputs": [first, other, again], "cached": [hit_a, hit_b, hit_a2],
                              "prompt_tokens": len(prompt)}
        elif scenario == "params":
            # Per-request control: a mistake is served by vLLM alone and reported; two
            # namespaces never share pages (vLLM's own cache emptied in between).
            prompt = system + conversations()[3][0]
            bad = _generate(llm, prompt, hicache={"bogus": 1})
            plain, _ = generate(llm, prompt)
            runs = []
            for ns in ("a", "b", "a"):
                llm.reset_prefix_cache()
                out = _generate(llm, prompt, hicache={"namespace": ns})
                runs.append((list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)))
            result["params"] = {
                "bad_output": list(bad.outputs[0].token_ids), "plain_output": plain,
                "bad_params": bad.kv_transfer_params, "prompt_tokens": len(prompt),
                "namespace_outputs": [o for o, _ in runs], "namespace_cached": [c for _, c in runs],
            }
        elif scenario == "lora":
            from vllm.lora.request import LoRARequest

            adapter = LoRARequest("A", 1, lora)
            p, q = system + conversations()[4][0], system + conversations()[5][0]
            runs = [(p, adapter), (p, None), (q, None), (q, adapter), (p, adapter), (p, None)]
            outs = [_after_reset(llm, prompt, a) for prompt, a in runs]
            result["lora"] = {"outputs": [o for o, _ in outs], "cached": [c for _, c in outs],
                              "prompt_tokens": [len(p) for p, _ in runs]}
        elif scenario == "embeds":
            import torch

            g = torch.Generator().manual_seed(1)
            e1, e2 = (torch.randn(300, 128, generator=g) for _ in range(2))
            outs = [_after_reset(llm, e) for e in (e1, e2, e1)]
            result["embeds"] = {"outputs": [o for o, _ in outs], "cached": [c for _, c in outs]}
        elif scenario == "replay":
            prompt = system + conversations()[0][0]
            out, hit = generate(llm, prompt)
            result["replay"] = {"output": out, "cached_tokens": hit, "prompt_tokens": len(prompt)}
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["make-model", "make-adapter", "run"])
    parser.add_argument("model")
    parser.add_argument("scenario", nargs="?")
    parser.add_argument("--storage")
    parser.add_argument("--no-connector", action="store_true")
    parser.add_argument("--policy", choices=["recompute", "fail"])
    parser.add_argument("--host-tokens", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--max-len", type=int, default=MAX_MODEL_LEN,
                        help="make-model: the model's max_position_embeddings")
    parser.add_argument("--write-policy")
    parser.add_argument("--extra", type=json.loads, default=None,
                        help="more kv_connector_extra_config fields (JSON)")
    parser.add_argument("--lora", help="a LoRA adapter's directory (make-adapter)")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.model, args.max_len)
        return
    if args.command == "make-adapter":
        make_adapter(args.model)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = run(args.model, args.scenario, not args.no_connector, args.storage, args.policy,
                 args.host_tokens, args.tp, args.write_policy, args.extra, args.lora)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
