"""A Llama-style reference decoder that reads and writes its KV through the device pool.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP,
with seeded random weights: the numbers are meaningless but the shapes, the
FLOPs and the KV traffic are those of the model a preset names, which is all a
cache needs to be measured against. The shapes and the presets (``tiny``,
``small``, ``llama3-8b-layers2``, ``llama3-70b-layers1``) are
:mod:`hicache.sim.modelconfig`.

Weights and activations default to ``float32``: on CPUs without bf16 matrix
units (this project's machine class) float32 matmuls run ~20x faster than
bfloat16 ones. Use ``bfloat16`` on a GPU.

How a sequence's tokens meet the pool in one ``forward`` call::

    positions  0 ............ start_pos ............ start_pos+T
               |  prefix: read  |  new tokens: written  |
    pages      [ page_table[0] ][ page_table[1] ] ...      position p lives in
                                                           page_table[p // page_size],
                                                           slot p % page_size

This module does not know the radix tree, the allocator or transfers: the
caller passes the page table, and optionally a load handle to wait on per layer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Protocol

import torch
import torch.nn.functional as F

from hicache.config import KVConfig
from hicache.memory import DevicePool, as_rows
from hicache.sim.modelconfig import PRESET_NAMES, ModelConfig, preset
from hicache.storage.keys import model_identity

# The model's shapes and presets live in hicache.sim.modelconfig; they are re-exported
# here, where users of the model look (``from hicache.sim.model import Model, preset``).
__all__ = ["PRESET_NAMES", "LayerLoadHandle", "Model", "ModelConfig", "preset"]

# enable_gqa= appeared in torch 2.5 ("2.13.0+cpu" -> (2, 13))
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
_DIGEST_CHUNK_NBYTES = 64 << 20  # unit of parallel hashing in weights_digest (part of its value)


class LayerLoadHandle(Protocol):
    """What ``forward`` needs of a load in flight: block until layer ``i`` has landed.

    Returning ``False`` means the layer will never land (the load failed).
    """

    def wait_layer(self, i: int) -> bool | None: ...


class _Layer:
    """Weights of one decoder layer, stored ``(in, out)`` so ``x @ w`` needs no transpose."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator, device: torch.device) -> None:
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def linear(n_in: int, n_out: int) -> torch.Tensor:
            # std 1/sqrt(fan_in) keeps every branch's output at unit scale, so the
            # residual stream grows slowly and RMSNorm sees well-conditioned inputs.
            w = torch.randn(n_in, n_out, generator=gen).mul_(1 / math.sqrt(n_in))
            return w.to(device=device, dtype=cfg.torch_dtype)

        self.attn_norm = torch.ones(h, device=device, dtype=cfg.torch_dtype)
        self.wq = linear(h, q_dim)
        self.wk = linear(h, kv_dim)
        self.wv = linear(h, kv_dim)
        self.wo = linear(q_dim, h)
        self.mlp_norm = torch.ones(h, device=device, dtype=cfg.torch_dtype)
        self.w_gate = linear(h, cfg.intermediate_size)
        self.w_up = linear(h, cfg.intermediate_size)
        self.w_down = linear(cfg.intermediate_size, h)


class Model:
    """Seeded random-weight decoder; same ``(config, seed)`` gives the same weights anywhere.

    Weights are drawn on the CPU from one ``torch.Generator`` and then moved, so a
    model on CUDA has the same weights as one on the CPU.
    """

    def __init__(self, config: ModelConfig, device: str = "cpu", seed: int = 0) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected ModelConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        cfg = config
        self.embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen).to(
            device=self.device, dtype=cfg.torch_dtype
        )  # (V, hidden)
        self.layers = [_Layer(cfg, gen, self.device) for _ in range(cfg.num_layers)]
        self.final_norm = torch.ones(cfg.hidden_size, device=self.device, dtype=cfg.torch_dtype)
        self.lm_head = (
            torch.randn(cfg.hidden_size, cfg.vocab_size, generator=gen)
            .mul_(1 / math.sqrt(cfg.hidden_size))
        ).to(device=self.device, dtype=cfg.torch_dtype)  # (hidden, V)
        half = cfg.head_dim // 2
        self._inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        ).to(device=self.device, dtype=torch.float32)  # (D/2,)
        self._weights_digest: str | None = None

    def weights_digest(self) -> str:
        """sha256 (first 32 hex digits) over every weight's dtype, shape and bytes, in order.

        Computed once (the weights never change after construction). Each tensor is
        hashed in 64 MiB chunks on a thread pool (hashlib releases the GIL), then the
        chunk digests in order, so the cost at engine start scales with weight bytes
        divided by cores.
        """
        if self._weights_digest is None:
            total = hashlib.sha256()
            workers = min(8, os.cpu_count() or 1)
            with ThreadPoolExecutor(workers, thread_name_prefix="hicache-digest") as pool:
                for t in self._weight_tensors():
                    cpu = t.detach().to("cpu").contiguous()  # one tensor on the host at a time
                    flat = cpu.reshape(-1).view(torch.uint8).numpy().data
                    chunks = [flat[i : i + _DIGEST_CHUNK_NBYTES]
                              for i in range(0, len(flat), _DIGEST_CHUNK_NBYTES)]
                    total.update(f"{cpu.dtype}{tuple(cpu.shape)};".encode())
                    for digest in pool.map(lambda c: hashlib.sha256(c).digest(), chunks):
                        total.update(digest)
            self._weights_digest = total.hexdigest()[:32]
        return self._weights_digest

    def identity(self) -> str:
        """This model's ``model_id`` for storage keys (see :func:`hicache.storage.model_identity`).

        Covers the preset name, every config field (RoPE base and norm epsilon change
        K too), the compute dtype and the weights' digest: two models share stored
        pages only when they compute the same KV.
        """
        cfg = {k: str(v) for k, v in asdict(self.config).items()}
        return model_identity(
            self.config.name,
            weights_digest=self.weights_digest(),
            dtype=str(self.config.torch_dtype).removeprefix("torch."),
            extra={"config": json.dumps(cfg, sort_keys=True)},
        )

    def _weight_tensors(self) -> list[torch.Tensor]:
        tensors = [self.embed]
        for layer in self.layers:
            tensors.extend(vars(layer).values())
        tensors += [self.final_norm, self.lm_head]
        return tensors

    @property
    def num_params(self) -> int:
        per_layer = sum(
            t.numel() for t in vars(self.layers[0]).values() if isinstance(t, torch.Tensor)
        )
        return (
            self.embed.numel() + self.lm_head.numel() + self.final_norm.numel()
            + per_layer * len(self.layers)
        )

    def kv_config(self, page_size: int = 16) -> KVConfig:
        return self.config.kv_config(page_size)

    # --- public entry points -------------------------------------------------

    def forward(
        self,
        token_ids: torch.Tensor,
        page_table: torch.Tensor,
        start_pos: int,
        pool: DevicePool,
        load_handle: LayerLoadHandle | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run ``T`` new tokens at positions ``[start_pos, start_pos+T)`` against the pool.

        Reads the KV of positions ``[0, start_pos)`` from ``pool`` through
        ``page_table`` (int64, the sequence's device page ids, long enough to cover
        ``start_pos + T`` positions) and writes the new tokens' KV into it; the new
        tokens may start mid-page (decode). If ``load_handle`` is given, its
        ``wait_layer(i)`` is called before layer ``i`` touches the pool, in layer
        order, so a layer-wise load overlaps compute.

        Returns float32 logits ``(T, vocab_size)``, or ``(1, vocab_size)`` for the
        last position only with ``last_only=True`` (prefill needs no more).
        """
        ids = self._check_tokens(token_ids)
        num_new = ids.numel()
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos: expected an int >= 0, got {start_pos!r}")
        page_size = self._check_pool(pool)
        total_len = start_pos + num_new
        pages = self._check_page_table(page_table, total_len, page_size, pool.num_pages)
        positions = torch.arange(start_pos, total_len, device=self.device)
        # Pool rows of the new tokens, counting (page, slot) as one flat row index.
        new_rows = pages[positions // page_size] * page_size + positions % page_size  # (T,)
        prefix_pages = pages[: -(-start_pos // page_size)] if start_pos else pages[:0]
        mask = self._causal_mask(start_pos, num_new)
        cos, sin = self._rope(positions)

        x = self.embed.index_select(0, ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # (T, H, D), (T, KVH, D) x2
            if load_handle is not None and load_handle.wait_layer(i) is False:
                # The load failed before this layer: its pages hold garbage.
                raise RuntimeError(f"load_handle: layer {i} of the prefix KV never arrived")
            k_buf, v_buf = pool.layer(i)  # (num_pages, page_size, KVH, D)
            k_all = self._write_and_gather(k_buf, k, new_rows, prefix_pages, start_pos)
            v_all = self._write_and_gather(v_buf, v, new_rows, prefix_pages, start_pos)
            x = self._finish_layer(layer, x, q, k_all, v_all, mask)
        return self._logits(x[-1:] if last_only else x)

    def prefill_reference(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal forward of ``token_ids`` from position 0, no pool: float32 ``(T, V)``.

        The correctness yardstick for :meth:`forward`; it keeps K and V in the
        model dtype, never rounding them through a pool.
        """
        ids = self._check_tokens(token_ids)
        positions = torch.arange(ids.numel(), device=self.device)
        cos, sin = self._rope(positions)
        x = self.embed.index_select(0, ids)
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, cos, sin)
            x = self._finish_layer(layer, x, q, k, v, None)
        return self._logits(x)

    __call__ = forward

    # --- validation ----------------------------------------------------------

    def _check_tokens(self, token_ids: object) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor):
            raise TypeError(f"token_ids: expected an int64 tensor, got {type(token_ids).__name__}")
        if token_ids.dtype != torch.int64:
            raise TypeError(f"token_ids: expected dtype torch.int64, got {token_ids.dtype}")
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(
                f"token_ids: expected a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}"
            )
        vocab = self.config.vocab_size
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab)]
        if bad.numel():
            raise ValueError(
                f"token id {int(bad[0])} is outside the vocabulary [0, {vocab}) "
                f"of model {self.config.name!r}"
            )
        return token_ids.to(self.device)

    def _check_pool(self, pool: DevicePool) -> int:
        cfg = self.config
        kv = getattr(pool, "kv", None)
        if not isinstance(kv, KVConfig):
            raise TypeError(f"pool: expected a DevicePool, got {type(pool).__name__}")
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        if want != got:
            raise ValueError(
                f"pool: expected KV shape (num_layers, num_kv_heads, head_dim)={want} "
                f"of model {cfg.name!r}, got {got}"
            )
        if pool.k_buffers[0].device != self.device:
            raise ValueError(
                f"pool: expected device {self.device}, got {pool.k_buffers[0].device}"
            )
        return kv.page_size

    def _check_page_table(
        self, page_table: object, total_len: int, page_size: int, num_pages: int
    ) -> torch.Tensor:
        if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int64:
            got = page_table.dtype if isinstance(page_table, torch.Tensor) else type(page_table)
            raise TypeError(f"page_table: expected an int64 tensor, got {got}")
        if page_table.dim() != 1:
            raise ValueError(
                f"page_table: expected a 1-D tensor, got shape {tuple(page_table.shape)}"
            )
        needed = -(-total_len // page_size)
        if page_table.numel() < needed:
            raise ValueError(
                f"page_table: expected >= {needed} pages to cover {total_len} positions "
                f"(page_size {page_size}), got {page_table.numel()}"
            )
        pages = page_table[:needed]
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(
                f"page_table: expected page ids in [0, {num_pages}), got min {lo}, max {hi}"
            )
        return pages.to(self.device)

    # --- building blocks -----------------------------------------------------

    def _causal_mask(self, start_pos: int, num_new: int) -> torch.Tensor | None:
        """Boolean ``(T, start_pos+T)`` mask, or None where SDPA needs none (see below)."""
        if start_pos == 0 or num_new == 1:
            # start_pos 0: SDPA's own is_causal (square). One query: it sees every key.
            return None
        key_pos = torch.arange(start_pos + num_new, device=self.device)
        query_pos = torch.arange(start_pos, start_pos + num_new, device=self.device)
        return key_pos[None, :] <= query_pos[:, None]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (T, 1, D)
        return angles.cos(), angles.sin()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return xf.to(x.dtype) * weight

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (T, heads, D)
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        h = self._rms_norm(x, layer.attn_norm)
        num_tokens = x.shape[0]
        q = (h @ layer.wq).view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = (h @ layer.wk).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ layer.wv).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    def _write_and_gather(
        self,
        buf: torch.Tensor,
        new: torch.Tensor,
        new_rows: torch.Tensor,
        prefix_pages: torch.Tensor,
        start_pos: int,
    ) -> torch.Tensor:
        """Store ``new`` (T, KVH, D) at its pool rows; return (start_pos+T, KVH, D) K or V."""
        num_pages, page_size = buf.shape[0], buf.shape[1]
        stored = new.to(buf.dtype).contiguous()
        as_rows(buf, num_pages * page_size).index_copy_(0, new_rows, as_rows(stored, len(stored)))
        if not start_pos:
            return stored.to(self.config.torch_dtype)
        # Whole pages in one gather; the last prefix page may hold new tokens too,
        # hence the slice to start_pos.
        prefix = buf.index_select(0, prefix_pages).flatten(0, 1)[:start_pos]
        return torch.cat((prefix, stored)).to(self.config.torch_dtype)

    def _finish_layer(
        self,
        layer: _Layer,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of q (T, H, D) over k, v (L, KVH, D), then the MLP; returns (T, hidden)."""
        cfg = self.config
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, len, D)
        is_causal = mask is None and q.shape[0] == k.shape[0] and q.shape[0] > 1
        if _SDPA_HAS_GQA:
            attn = F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=mask, is_causal=is_causal, enable_gqa=True
            )
        else:
            group = cfg.num_heads // cfg.num_kv_heads
            attn = F.scaled_dot_product_attention(
                q4, k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1),
                attn_mask=mask, is_causal=is_causal,
            )
        attn = attn.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1)  # (T, H*D)
        x = x + attn @ layer.wo
        h = self._rms_norm(x, layer.mlp_norm)
        return x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(x, self.final_norm) @ self.lm_head).float()
