"""The shapes of a Llama-style decoder, and the named presets the reference model runs.

Presets:

- ``tiny``: tests (2 layers, hidden 64).
- ``small``: the demo (4 layers, hidden 256; a ~4k-token CPU prefill takes ~1 s).
- ``llama3-8b-layers2`` / ``llama3-70b-layers1``: the exact per-layer shapes of
  Llama-3-8B / -70B (and their 128,256-token vocabulary) for 2 / 1 layers.
  Recompute and reload both scale per layer, so their ratio carries over to the
  full model.

A :class:`ModelConfig` also names its KV layout (:meth:`ModelConfig.kv_config`), what a
pool for the model must hold; the model itself is :class:`hicache.sim.model.Model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.config import KVConfig, resolve_dtype

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-style decoder."""

    name: str  # preset name, for reports
    vocab_size: int  # token ids are in [0, vocab_size)
    hidden_size: int  # residual stream width
    num_layers: int  # decoder layers, each with its own KV
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads; num_heads is a multiple (GQA)
    head_dim: int  # channels per head
    intermediate_size: int  # SwiGLU inner width
    rope_theta: float = 500000.0  # RoPE base (Llama 3)
    dtype: str | torch.dtype = "float32"  # weights, activations and (by default) KV
    rms_eps: float = 1e-5  # RMSNorm epsilon

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "intermediate_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                f"got {self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE), got {self.head_dim}")
        dtype = resolve_dtype(self.dtype)
        if dtype not in _MODEL_DTYPES:
            raise ValueError(
                f"dtype: expected one of float32, bfloat16, float16, got {dtype}"
            )
        object.__setattr__(self, "dtype", dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype  # type: ignore[return-value]

    def kv_config(self, page_size: int = 16, dtype: str | torch.dtype | None = None) -> KVConfig:
        """The KV layout of this model: what a pool for it must hold (KV dtype = model dtype)."""
        return KVConfig(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            page_size=page_size,
        )


_PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("tiny", 32000, 64, 2, 4, 2, 16, 128, rope_theta=10000.0),
        ModelConfig("small", 32000, 256, 4, 4, 2, 64, 768),
        ModelConfig("llama3-8b-layers2", 128256, 4096, 2, 32, 8, 128, 14336),
        ModelConfig("llama3-70b-layers1", 128256, 8192, 1, 64, 8, 128, 28672),
    )
}
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name``, optionally with another dtype."""
    if name not in _PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESET_NAMES)}, got {name!r}")
    cfg = _PRESETS[name]
    if dtype is None:
        return cfg
    return ModelConfig(**{**cfg.__dict__, "dtype": dtype})
