"""The shapes of a Llama-style decoder, and the named presets the reference model runs.

Presets:

- ``tiny``: tests (2 layers, hidden 64).
- ``small``: the demo (4 layers, hidden 256; a ~4k-token CPU prefill takes ~1 s).
- ``llama3-8b-layers2`` / ``llama3-70b-layers1``: the exact per-layer shapes of
  Llama-3-8B / -70B (and their 128,256-token vocabulary) for 2 / 1 layers.
  Recompute and reload both scale per layer, so their ratio carries over to the
  full model.
- ``tiny-hybrid`` / ``small-hybrid``: hybrid models (docs/design.md, "Hybrid models:
  components"): sliding-window attention and a linear-attention recurrence beside
  full attention, ``tiny``-sized for tests, ``small``-sized for the demo and the
  benchmarks (Gemma-style window layers 2 to 1, Qwen3-Next-style linear layers 1 to 1).

A :class:`ModelConfig` also names its KV layout (:meth:`ModelConfig.kv_config`), what a
pool for the model must hold: for a hybrid model, one page holds the full-attention
layers' KV, and the window and linear layers are components of the cache whose pages
hold as many layers each (their ``width`` pages per token page or per state); the
model itself is :class:`hicache.sim.model.Model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.components import ComponentSpec
from hicache.config import KVConfig, resolve_dtype

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYER_KINDS = ("full", "window", "linear")


class LayerSlot(NamedTuple):
    """Where one layer's KV (or state) lives in a page of the pool."""

    kind: str  # "full", "window" or "linear"
    component: int  # its component's index in kv_config().components; -1: full attention
    group: int  # which of the component's ``width`` page ids per token page holds it
    slot: int  # its layer within the page (the pool layer index)


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
    # Hybrid models: each layer's kind ("full", "window", "linear"); () means all full.
    layer_kinds: tuple[str, ...] = ()
    window_tokens: int = 0  # window layers: a token attends to itself and the W - 1 before it
    state_dim: int = 0  # linear layers: the state is (num_kv_heads, state_dim, head_dim)

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
        self._check_kinds()

    def _check_kinds(self) -> None:
        kinds = tuple(self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        if kinds and (len(kinds) != self.num_layers or not set(kinds) <= set(LAYER_KINDS)):
            raise ValueError(
                f"layer_kinds: expected {self.num_layers} of {list(LAYER_KINDS)}, got {kinds}")
        if kinds and "full" not in kinds:
            raise ValueError("layer_kinds: expected at least one 'full' layer (a page holds them)")
        for name, kind, low in (("window_tokens", "window", 2), ("state_dim", "linear", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
            if (kind in kinds) != (value >= low) or value < 0:
                raise ValueError(
                    f"{name}: expected >= {low} with '{kind}' layers and 0 without, got {value}")

    @property
    def num_full_layers(self) -> int:
        """Full-attention layers: the layers one page of the pool holds."""
        return sum(k == "full" for k in self.layer_kinds) if self.layer_kinds else self.num_layers

    def components(self) -> tuple[ComponentSpec, ...]:
        """The cache components of the window and linear layers (window first)."""
        out = []
        per_page = self.num_full_layers
        for kind, spec_kind in (("window", "window"), ("linear", "state")):
            num = sum(k == kind for k in self.layer_kinds)
            if num:
                width = -(-num // per_page)
                window = self.window_tokens if kind == "window" else 0
                out.append(ComponentSpec(spec_kind, window_tokens=window, width=width))
        return tuple(out)

    def layer_slots(self) -> list[LayerSlot]:
        """Each layer's place in the pool (:class:`LayerSlot`), in layer order."""
        per_page = self.num_full_layers
        kinds = self.layer_kinds or ("full",) * self.num_layers
        index = {"full": -1}
        for c, name in enumerate(n for n in ("window", "linear") if n in kinds):
            index[name] = c
        seen = dict.fromkeys(LAYER_KINDS, 0)
        out = []
        for kind in kinds:
            k = seen[kind]
            seen[kind] += 1
            out.append(LayerSlot(kind, index[kind], k // per_page, k % per_page))
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype  # type: ignore[return-value]

    def kv_config(self, page_size: int = 16, dtype: str | torch.dtype | None = None) -> KVConfig:
        """The KV layout of this model: what a pool for it must hold (KV dtype = model dtype).

        A linear layer's state ``(num_kv_heads, state_dim, head_dim)`` takes the first
        ``state_dim`` token rows of one page's K: ``page_size`` must be at least that.
        """
        if self.state_dim > page_size:
            raise ValueError(
                f"page_size: a linear layer's state takes {self.state_dim} token rows of a "
                f"page (state_dim); expected page_size >= {self.state_dim}, got {page_size}")
        return KVConfig(
            num_layers=self.num_full_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            page_size=page_size,
            components=self.components(),
        )


_PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("tiny", 32000, 64, 2, 4, 2, 16, 128, rope_theta=10000.0),
        ModelConfig("small", 32000, 256, 4, 4, 2, 64, 768),
        ModelConfig("llama3-8b-layers2", 128256, 4096, 2, 32, 8, 128, 14336),
        ModelConfig("llama3-70b-layers1", 128256, 8192, 1, 64, 8, 128, 28672),
        ModelConfig("tiny-hybrid", 32000, 64, 6, 4, 2, 16, 128, rope_theta=10000.0,
                    layer_kinds=("window", "full", "linear") * 2, window_tokens=24,
                    state_dim=8),
        ModelConfig("small-hybrid", 32000, 256, 8, 4, 2, 64, 768,
                    layer_kinds=("window", "window", "linear", "full") * 2,
                    window_tokens=128, state_dim=16),
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
