"""Analytic cost model: KV bytes and prefill FLOPs per token, and what they cost on a GPU.

Everything here is an ESTIMATE from shapes and datasheet numbers, never a
measurement; benchmarks print it beside what they measured. It counts matmul
FLOPs only (norms, RoPE and softmax are a rounding error at these sizes) and
does not know caches, pools or kernels.

Assumptions, stated once:

- Dense bf16 tensor-core throughput from the datasheet (H100 SXM and H200 share
  the same compute: ~989 TFLOP/s), at ``mfu`` = 50% achieved during prefill.
- Host-to-device over PCIe Gen5 x16: 64 GB/s raw per direction, ~50 GB/s
  effective for large pinned copies.
- Prefill from position 0 with causal attention: token ``p`` attends ``p+1``
  keys. The LM head is left out: prefill needs the last position's logits only.
- Llama-3 full models: 8B (32 layers) and 70B (80 layers), KV in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.config import resolve_dtype
from hicache.sim.modelconfig import ModelConfig


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet numbers of one accelerator and its host link."""

    name: str
    bf16_dense_tflops: float  # tensor-core peak, no sparsity
    pcie_gbps: float  # effective host-to-device GB/s (1e9 bytes/s) for large pinned copies


GPUS: dict[str, GPUSpec] = {
    "H100-SXM": GPUSpec("H100-SXM", 989.0, 50.0),
    "H200": GPUSpec("H200", 989.0, 50.0),
}

FULL_MODELS: dict[str, ModelConfig] = {
    "Llama-3-8B": ModelConfig("Llama-3-8B", 128256, 4096, 32, 32, 8, 128, 14336, dtype="bfloat16"),
    "Llama-3-70B": ModelConfig(
        "Llama-3-70B", 128256, 8192, 80, 64, 8, 128, 28672, dtype="bfloat16"
    ),
}

DEFAULT_MFU = 0.5


def kv_bytes_per_token(cfg: ModelConfig, dtype: str | torch.dtype | None = None) -> int:
    """Bytes of K plus V of one token over the layers that keep KV per token: every layer
    but a hybrid model's linear ones, which keep a state instead (KV dtype defaults to the
    model's). A window layer counts: each token has K and V there, only fewer are kept."""
    kv_dtype = cfg.torch_dtype if dtype is None else resolve_dtype(dtype)
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    layers = cfg.num_layers - sum(kind == "linear" for kind in cfg.layer_kinds)
    return 2 * layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def layer_params(cfg: ModelConfig) -> int:
    """Matmul weights of one decoder layer (attention projections and SwiGLU)."""
    q_dim = cfg.num_heads * cfg.head_dim
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (2 * q_dim + 2 * kv_dim)  # wq, wo, wk, wv
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    return attn + mlp


def prefill_flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """FLOPs of one token that attends ``context_len`` keys (itself included).

    ``2 x layer params`` for the projections and MLP, plus ``4 x H x D x context_len``
    per layer for ``Q K^T`` and ``attn V``.
    """
    if context_len < 1:
        raise ValueError(f"context_len: expected >= 1, got {context_len}")
    attention = 4 * cfg.num_heads * cfg.head_dim * context_len
    return cfg.num_layers * (2 * layer_params(cfg) + attention)


def prefill_flops(cfg: ModelConfig, num_tokens: int) -> float:
    """FLOPs to prefill ``num_tokens`` from position 0 (the sum of the per-token cost)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    dense = cfg.num_layers * 2 * layer_params(cfg) * num_tokens
    # sum over p of (p + 1) keys = n (n + 1) / 2
    attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * num_tokens * (num_tokens + 1) / 2
    return dense + attention


class Estimate(NamedTuple):
    """ESTIMATE of recomputing vs reloading a prefix of ``tokens`` tokens."""

    model: str
    gpu: str
    tokens: int
    recompute_ms: float
    reload_ms: float
    ratio: float  # recompute_ms / reload_ms: how much cheaper a reload is


def estimate_recompute_vs_reload(
    model: str | ModelConfig,
    gpu: str | GPUSpec,
    tokens: int,
    mfu: float = DEFAULT_MFU,
    kv_dtype: str | torch.dtype = "bfloat16",
) -> Estimate:
    """ESTIMATE: prefill ``tokens`` at ``mfu`` of peak vs loading their KV over PCIe."""
    cfg = _lookup(FULL_MODELS, model, "model") if isinstance(model, str) else model
    spec = _lookup(GPUS, gpu, "gpu") if isinstance(gpu, str) else gpu
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: expected a fraction in (0, 1], got {mfu}")
    recompute_s = prefill_flops(cfg, tokens) / (spec.bf16_dense_tflops * 1e12 * mfu)
    reload_s = tokens * kv_bytes_per_token(cfg, kv_dtype) / (spec.pcie_gbps * 1e9)
    return Estimate(
        cfg.name, spec.name, tokens, recompute_s * 1e3, reload_s * 1e3, recompute_s / reload_s
    )


def estimate_table(tokens: int, mfu: float = DEFAULT_MFU) -> list[Estimate]:
    """The estimate for every full model on every GPU in the tables, at one prefix length."""
    return [
        estimate_recompute_vs_reload(m, g, tokens, mfu) for m in FULL_MODELS for g in GPUS
    ]


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        raise ValueError(f"{what}: expected one of {list(table)}, got {key!r}")
    return table[key]
