"""The inputs of ``hicache bench vllm``: the model's shape, the requests and the sizes.

A run needs a model directory (a random Llama-style model of a :data:`PRESETS`
shape, made with ``transformers``, or ``--model``), the requests (a trace or a
generated :data:`WORKLOADS` workload) and a :class:`Plan`: the block size, vLLM's
capped KV cache and the host tiers, all derived from the trace's working set. The
command line and the runs are :mod:`hicache.cli.benchmarks.vllm`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NamedTuple

from hicache.sim.traces import Request, load_trace, trace_stats
from hicache.sim.workloads import generate


class ModelShape(NamedTuple):
    """A Llama-style decoder's sizes (what ``LlamaConfig`` takes), or with
    ``sliding_window`` a Gemma-3-style hybrid one (``Gemma3TextConfig``): every
    ``full_every``-th layer full attention, the others sliding-window attention."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    sliding_window: int = 0  # tokens; 0: every layer full attention (Llama)
    full_every: int = 0  # hybrid: layers i with (i + 1) % full_every == 0 are full attention

    @property
    def hybrid(self) -> bool:
        return self.sliding_window > 0

    @property
    def num_window_groups(self) -> int:
        """vLLM's KV cache groups of sliding-window layers (its hybrid manager groups
        layers by the full-attention layer count): 0 for a Llama shape."""
        if not self.hybrid:
            return 0
        full = self.num_layers // self.full_every
        return -(-(self.num_layers - full) // full)

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
                for i in range(self.num_layers)]

    @property
    def kv_nbytes_per_token(self) -> int:  # float32 K and V of every layer
        return 2 * self.num_layers * self.num_kv_heads * (self.hidden_size // self.num_heads) * 4

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * (self.hidden_size // self.num_heads)
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


# On this project's 2-core machines (float32, vLLM's CPU backend, the worker on one
# core; measured): "small" computes a 576-token prompt in ~0.3 s and serves it from
# vLLM's cache in ~0.07 s; "medium" computes a prompt token in ~1.5 ms. Once hicache
# serves the prefixes, what is left of a request's time is mostly decode steps, which
# read every weight, the 32,000-word output layer included (over half of what a decode
# step of "small" reads): with "small" they outweigh the prefill left, with "medium"
# they weigh about as much. Hence "medium" by default (a default agentic run takes ~9
# minutes, "small" ~3); "tiny" is for tests (fixed costs dominate it).
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(2, 128, 4, 4, 352, 32000),
    "small": ModelShape(4, 512, 8, 8, 1408, 32000),
    "medium": ModelShape(8, 768, 12, 12, 2048, 32000),
    # Gemma-3's pattern, 5 sliding-window layers to 1 full-attention layer, "small"'s
    # width. Gemma-3's window is 1,024 tokens for contexts of 32k-128k; here prompts are
    # 768-1,408 tokens and the window 32, in the same proportion. The host tier keeps a
    # window's tail at each prompt's end: what it saves grows with the tokens between
    # two ends (an agentic turn adds 128) over the window (docs/benchmarks.md).
    "hybrid": ModelShape(6, 512, 8, 8, 1408, 32000, sliding_window=32, full_every=6),
}
DEFAULT_PRESET = "medium"

# Bench-sized workloads (a 2-core machine computes ~2-3k prompt tokens/s with "small").
WORKLOADS: dict[str, dict[str, int | float]] = {
    # Agent loops whose own context dominates: 2 shared 256-token system prompts, 32
    # sessions x 6 turns (a 512-token task, then 96-token tool results after 32-token
    # steps): 192 requests of 768-1,408 tokens, 37,376-token working set. (The trace
    # generator's default shape, that of the sample trace, is mostly 8 shared system
    # prompts: there vLLM's own LRU keeps most hits and no tier can cut computed
    # prompt tokens by more than ~2.3x; pass --trace to measure it.)
    "agentic": {"num_system_prompts": 2, "system_tokens": 256, "num_sessions": 32,
                "num_turns": 6, "first_turn_tokens": 512, "turn_tokens": 96,
                "output_tokens": 32},
    "multiturn": {"num_clients": 16, "min_rounds": 3, "max_rounds": 5, "system_tokens": 256,
                  "user_tokens": 128, "output_tokens": 64},
    # Chat whose turns are short: each adds 28-112 tokens (a user line and a reply) to the
    # history; 24 clients x 4-8 rounds after a 96-token system prompt. SGLang's fixed
    # 256-token prefetch threshold turns away nearly every third-tier hit of it.
    "chat": {"num_clients": 24, "min_rounds": 4, "max_rounds": 8, "system_tokens": 96,
             "user_tokens": 40, "output_tokens": 30, "jitter": 0.6},
    "longdoc": {"num_docs": 6, "min_doc_tokens": 1024, "max_doc_tokens": 2048,
                "questions_per_doc": 3},
    "noreuse": {"num_requests": 64, "min_prompt_tokens": 256, "max_prompt_tokens": 1024},
}


# The generator (hicache/sim/workloads.py) of a workload named otherwise
GENERATOR_OF = {"chat": "multiturn"}


class UsageError(Exception):
    """A bad command line: one line on stderr, exit code 2."""



def make_random_model(shape: ModelShape, directory: str, seed: int) -> None:
    """Save a randomly initialized ``LlamaForCausalLM`` of ``shape`` into ``directory``
    (a ``Gemma3ForCausalLM`` text model for a hybrid shape)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's own progress bars are the ones to read
    torch.manual_seed(seed)
    if shape.hybrid:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        gemma = Gemma3TextConfig(
            vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.hidden_size // shape.num_heads, sliding_window=shape.sliding_window,
            layer_types=shape.layer_types(), max_position_embeddings=32768,
            tie_word_embeddings=False)
        Gemma3ForCausalLM(gemma).save_pretrained(directory)
        return
    cfg = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size,
                      num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                      num_key_value_heads=shape.num_kv_heads, max_position_embeddings=32768,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(directory)


def model_shape_of(directory: str) -> ModelShape:
    """The shape recorded in a model directory's ``config.json``."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    try:
        heads = cfg["num_attention_heads"]
        types = cfg.get("layer_types") or []
        window = (cfg.get("sliding_window") or 0) if "sliding_attention" in types else 0
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        return ModelShape(cfg["num_hidden_layers"], cfg["hidden_size"], heads,
                          cfg.get("num_key_value_heads", heads), cfg["intermediate_size"],
                          cfg["vocab_size"], sliding_window=window,
                          full_every=full[0] + 1 if window and full else 0)
    except KeyError as e:
        raise UsageError(f"--model: expected a Llama-style config.json, missing {e}") from None


def load_requests(args: argparse.Namespace) -> list[Request]:
    if args.trace is not None:
        try:
            requests = load_trace(args.trace)
        except (ValueError, OSError) as e:
            raise UsageError(f"--trace: {e}") from None
    else:
        name = args.workload or "agentic"
        requests = generate(GENERATOR_OF.get(name, name), seed=args.seed, **WORKLOADS[name])
    if args.num_requests is not None:
        requests = requests[: args.num_requests]
    if not requests or min(len(r.prompt) for r in requests) == 0:
        raise UsageError("the trace: expected requests with non-empty prompts")
    return requests


class Plan(NamedTuple):
    """Sizes shared by every configuration of one run."""

    block_size: int
    max_model_len: int
    working_set_tokens: int  # distinct page-aligned prompt prefixes (what can ever hit)
    vllm_blocks: int
    host_tokens: int  # vllm+host (unless --host-gb)
    small_host_tokens: int  # vllm+host+storage
    # vllm-fits: every block the trace ever fills (its working set, and each request's
    # blocks past its last whole prompt block), plus vLLM's null block: nothing evicted
    fits_blocks: int


def make_plan(args: argparse.Namespace, requests: list[Request],
              shape: ModelShape | None = None) -> Plan:
    B = args.block_size
    longest = max(len(r.prompt) + max_tokens_of(r, args.max_tokens) for r in requests)
    max_model_len = -(-longest // B) * B
    prompts_only = [r._replace(output=[]) for r in requests]
    ws = trace_stats(prompts_only, B).working_set_tokens
    # vLLM must fit one longest sequence; a hybrid model's sliding-window groups hold a
    # block of each token of a prefill chunk too, until the step after it
    groups = 1 + (shape.num_window_groups if shape is not None else 0)
    min_blocks = groups * (max_model_len // B + 1)
    vllm_blocks = args.vllm_blocks if args.vllm_blocks is not None else max(ws // B // 4,
                                                                           min_blocks)
    if vllm_blocks < min_blocks:
        raise UsageError(f"--vllm-blocks: expected >= {min_blocks} (one {max_model_len}-token "
                         f"sequence in {B}-token blocks), got {vllm_blocks}")
    generated = sum(max_tokens_of(r, args.max_tokens) for r in requests)
    host_tokens = -(-(ws + generated) // B) * B + 16 * B  # slack: partial turns, in flight
    small_host = (args.storage_host_tokens // B * B if args.storage_host_tokens is not None
                  else max(ws // 4 // B * B, 2 * max_model_len))
    tails = sum(-(-(len(r.prompt) % B + max_tokens_of(r, args.max_tokens)) // B)
                for r in requests)
    fits_blocks = max(vllm_blocks, groups * (ws // B + tails) + 1)
    return Plan(B, max_model_len, ws, vllm_blocks, host_tokens, small_host, fits_blocks)


def max_tokens_of(req: Request, cap: int) -> int:
    """Tokens to generate for ``req``: ``min(len(output), cap)``, at least 1 (``cap`` without
    an output)."""
    return max(1, min(len(req.output), cap)) if len(req.output) else cap
