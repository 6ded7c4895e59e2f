"""Runs one vLLM engine (CPU backend) on a tiny hybrid model and prints one JSON line.

Used by tests/integrations/test_vllm_hybrid_e2e.py in a subprocess (vLLM spawns
processes). vLLM's hybrid KV cache manager is forced on (as a Gemma user would:
``disable_hybrid_kv_cache_manager=False``), with or without the connector. Usage::

    python tests/integrations/vllm_hybrid_driver.py make-model DIR [--kind gemma3|qwen3next]
    python tests/integrations/vllm_hybrid_driver.py run DIR SCENARIO[,SCENARIO...] [--kind K]
        [--storage file:DIR] [--no-connector] [--policy recompute|fail] [--host-tokens N]
        [--extra JSON]

Models (random weights): ``gemma3`` is a Gemma-3 text model of 4 layers, sliding window
(128 tokens) and full attention alternating; ``qwen3next`` a Qwen3-Next model of 4
layers, linear attention (Gated DeltaNet: a recurrent state, vLLM's Mamba "align"
mode) and full attention alternating, in bfloat16 (vLLM's CPU kernel for it needs
AVX-512 BF16). Scenarios: ``multiturn`` (conversations whose working set is several
times vLLM's KV cache, one request at a time, each turn the whole history: most of a
prompt was computed by an earlier turn), ``replay`` (the first prompt of
``multiturn``: meant for a second process on the same storage). ``HICACHE_FAULTS``
in the environment makes the connector's worker fail some copies
(hicache/integrations/vllm/worker/faults.py). The last stdout line is a JSON object
with one entry per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

VOCAB = 512
MAX_MODEL_LEN = 512
OUTPUT_TOKENS = 16
# Per model: vLLM's block size, its KV blocks (a few requests' worth: the multi-turn
# working set is several times that), the compute dtype, and the workload's shape
# (conversations, turns, system prompt and user tokens per turn).
SHAPES = {
    "gemma3": {"block_size": 32, "num_blocks": 36, "dtype": "float32",
               "conversations": 6, "turns": 6, "system": 128, "user": 32},
    "qwen3next": {"block_size": None, "num_blocks": 12, "dtype": "bfloat16",
                  "conversations": 4, "turns": 3, "system": 96, "user": 96},
}


def make_model(path: str, kind: str) -> None:
    import torch

    torch.manual_seed(0)
    if kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        # Untied, wide initialisation: greedy outputs depend on the whole context (a
        # tied tiny Gemma repeats its last token), so wrong KV shows in the output.
        cfg = Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 2,
            max_position_embeddings=MAX_MODEL_LEN * 2, initializer_range=0.2,
            tie_word_embeddings=False)
        Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    elif kind == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # vLLM's CPU Gated DeltaNet takes 128-wide heads; one of them keeps the state
        # (64 KiB) under an attention block of vLLM's choosing (96 tokens here).
        cfg = Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128,
            linear_num_value_heads=1, linear_num_key_heads=1, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=MAX_MODEL_LEN * 2,
            initializer_range=0.2, tie_word_embeddings=False)
        Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    else:
        raise SystemExit(f"unknown kind {kind!r}")


def make_llm(model: str, kind: str, connector: bool, storage: str | None,
             policy: str | None, host_tokens: int, extra_fields: dict | None):
    from vllm import LLM

    shape = SHAPES[kind]
    kwargs: dict = {}
    if connector:
        extra: dict = {"host_tokens": host_tokens, **(extra_fields or {})}
        if storage:
            extra["storage"] = storage
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiCacheConnector",
            "kv_connector_module_path": "hicache.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra,
        }
        if policy:
            kwargs["kv_transfer_config"]["kv_load_failure_policy"] = policy
    if shape["block_size"] is not None:
        kwargs["block_size"] = shape["block_size"]
    return LLM(
        model=model, skip_tokenizer_init=True, dtype=shape["dtype"], enforce_eager=True,
        max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=shape["num_blocks"],
        gpu_memory_utilization=0.1, max_num_seqs=4, seed=0, enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False, **kwargs,
    )


def workload(kind: str) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and per conversation and turn the user's tokens."""
    shape = SHAPES[kind]
    rng = random.Random(1)
    system = [rng.randrange(1, VOCAB) for _ in range(shape["system"])]
    users = [[[rng.randrange(1, VOCAB) for _ in range(shape["user"])]
              for _ in range(shape["turns"])] for _ in range(shape["conversations"])]
    return system, users


def run(model: str, kind: str, scenarios: str, connector: bool, storage: str | None,
        policy: str | None, host_tokens: int, extra_fields: dict | None) -> dict:
    from vllm_driver import _generate

    llm = make_llm(model, kind, connector, storage, policy, host_tokens, extra_fields)
    shape = SHAPES[kind]
    system, users = workload(kind)
    result: dict = {"connector": connector, "shape": shape}
    for scenario in scenarios.split(","):
        if scenario == "multiturn":
            history = [list(system) for _ in users]
            outputs, prompts, cached, finish = [], [], [], []
            for turn in range(shape["turns"]):
                for c, conv in enumerate(users):
                    history[c] += conv[turn]
                    prompts.append(list(history[c]))
                    try:
                        out = _generate(llm, history[c])
                        tokens = list(out.outputs[0].token_ids)
                        finish.append(str(out.outputs[0].finish_reason))
                        cached.append(int(out.num_cached_tokens or 0))
                    except Exception as exc:  # noqa: BLE001 - a failed request is data here
                        tokens = []
                        finish.append(f"exception: {type(exc).__name__}")
                        cached.append(0)
                    outputs.append(tokens)
                    # The next turn follows this output (a fixed filler if it failed).
                    history[c] += tokens or conv[turn][:OUTPUT_TOKENS]
            result["multiturn"] = {
                "outputs": outputs, "prompts": prompts, "cached_per_request": cached,
                "cached_tokens": sum(cached), "prompt_tokens": sum(map(len, prompts)),
                "finish": finish,
            }
        elif scenario == "replay":
            prompt = system + users[0][0]
            out = _generate(llm, prompt)
            result["replay"] = {"output": list(out.outputs[0].token_ids),
                                "cached_tokens": int(out.num_cached_tokens or 0),
                                "prompt_tokens": len(prompt)}
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["make-model", "run"])
    parser.add_argument("model")
    parser.add_argument("scenario", nargs="?")
    parser.add_argument("--kind", choices=sorted(SHAPES), default="gemma3")
    parser.add_argument("--storage")
    parser.add_argument("--no-connector", action="store_true")
    parser.add_argument("--policy", choices=["recompute", "fail"])
    parser.add_argument("--host-tokens", type=int, default=16384)
    parser.add_argument("--extra", type=json.loads, default=None,
                        help="more kv_connector_extra_config fields (JSON)")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.model, args.kind)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    result = run(args.model, args.kind, args.scenario, not args.no_connector, args.storage,
                 args.policy, args.host_tokens, args.extra)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
