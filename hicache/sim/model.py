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

A hybrid preset (``tiny-hybrid``, ``small-hybrid``) also has sliding-window and
linear-recurrence layers (:mod:`hicache.sim.layers`); the caller then passes
``components``, one entry per cache component of the model's KV layout
(:meth:`ModelConfig.components`): a window component's page table
``(num_pages, width)`` (``PrefixHandle.window_table``), a state component's pages
(``PrefixHandle.state_pages``: the checkpoint to start from, the running state, the
checkpoints to write). A layer's pool layer is its slot in a page
(:meth:`ModelConfig.layer_slots`): ``load_handle.wait_layer`` gets that slot.

This module does not know the radix tree, the allocator or transfers: the
caller passes the page table, and optionally a load handle to wait on per layer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Protocol

import torch
import torch.nn.functional as F

from hicache.config import KVConfig
from hicache.memory import DevicePool, as_rows
from hicache.sim.layers import decays, recur, window_mask
from hicache.sim.modelchecks import (
    StateIO,
    check_components,
    check_page_table,
    check_pool,
    check_tokens,
)
from hicache.sim.modelconfig import PRESET_NAMES, LayerSlot, ModelConfig, preset
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
    """Weights of one decoder layer, stored ``(in, out)`` so ``x @ w`` needs no transpose.

    A linear layer's query and key projections map to ``state_dim`` per head.
    """

    def __init__(self, cfg: ModelConfig, gen: torch.Generator, device: torch.device,
                 kind: str = "full") -> None:
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        key_dim = cfg.state_dim if kind == "linear" else cfg.head_dim

        def linear(n_in: int, n_out: int) -> torch.Tensor:
            # std 1/sqrt(fan_in) keeps every branch's output at unit scale, so the
            # residual stream grows slowly and RMSNorm sees well-conditioned inputs.
            w = torch.randn(n_in, n_out, generator=gen).mul_(1 / math.sqrt(n_in))
            return w.to(device=device, dtype=cfg.torch_dtype)

        self.attn_norm = torch.ones(h, device=device, dtype=cfg.torch_dtype)
        self.wq = linear(h, cfg.num_heads * key_dim)
        self.wk = linear(h, cfg.num_kv_heads * key_dim)
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
        self._slots: list[LayerSlot] = cfg.layer_slots()
        self.layers = [_Layer(cfg, gen, self.device, s.kind) for s in self._slots]
        self._decay = decays(cfg.num_kv_heads, self.device)  # linear layers' state decay
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
        layers = sum(t.numel() for layer in self.layers for t in vars(layer).values()
                     if isinstance(t, torch.Tensor))
        return self.embed.numel() + self.lm_head.numel() + self.final_norm.numel() + layers

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
        components: Sequence[torch.Tensor | StateIO] | None = None,
    ) -> torch.Tensor:
        """Run ``T`` new tokens at positions ``[start_pos, start_pos+T)`` against the pool.

        Reads the KV of positions ``[0, start_pos)`` from ``pool`` through
        ``page_table`` (int64, the sequence's device page ids, long enough to cover
        ``start_pos + T`` positions) and writes the new tokens' KV into it; the new
        tokens may start mid-page (decode). If ``load_handle`` is given, its
        ``wait_layer(i)`` is called before a layer in pool slot ``i`` touches the pool,
        in layer order, so a layer-wise load overlaps compute. A hybrid model takes
        ``components`` (module docstring): its window layers read and write through
        their page tables, its linear layers their states and checkpoints.

        Returns float32 logits ``(T, vocab_size)``, or ``(1, vocab_size)`` for the
        last position only with ``last_only=True`` (prefill needs no more).
        """
        ids = check_tokens(self.config, self.device, token_ids)
        num_new = ids.numel()
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos: expected an int >= 0, got {start_pos!r}")
        page_size = check_pool(self.config, self.device, pool)
        total_len = start_pos + num_new
        pages = check_page_table(self.device, page_table, total_len, page_size, pool.num_pages)
        comps = check_components(self.config, components)
        positions = torch.arange(start_pos, total_len, device=self.device)
        # Pool rows of the new tokens, counting (page, slot) as one flat row index.
        new_rows = pages[positions // page_size] * page_size + positions % page_size  # (T,)
        prefix_pages = pages[: -(-start_pos // page_size)] if start_pos else pages[:0]
        mask = self._causal_mask(start_pos, num_new)
        cos, sin = self._rope(positions)

        x = self.embed.index_select(0, ids)  # (T, hidden)
        for layer, where in zip(self.layers, self._slots, strict=True):
            if where.kind == "linear":
                q, k, v = self._qkv_linear(layer, x)
            else:
                q, k, v = self._qkv(layer, x, cos, sin)  # (T, H, D), (T, KVH, D) x2
            if load_handle is not None and load_handle.wait_layer(where.slot) is False:
                # The load failed before this layer: its pages hold garbage.
                raise RuntimeError(f"load_handle: layer {where.slot} of the prefix KV never arrived")
            k_buf, v_buf = pool.layer(where.slot)  # (num_pages, page_size, KVH, D)
            if where.kind == "full":
                k_all = self._write_and_gather(k_buf, k, new_rows, prefix_pages, start_pos)
                v_all = self._write_and_gather(v_buf, v, new_rows, prefix_pages, start_pos)
                attn = self._attend(q, k_all, v_all, mask)
            elif where.kind == "window":
                table = comps[where.component]
                assert isinstance(table, torch.Tensor), "checked: a window page table"
                attn = self._window(q, k, v, k_buf, v_buf, table[:, where.group], positions)
            else:
                state = comps[where.component]
                assert not isinstance(state, torch.Tensor), "checked: a state's pages"
                attn = self._linear(q, k, v, k_buf, state, where.group, start_pos)
            x = self._residual_mlp(layer, x, attn)
        return self._logits(x[-1:] if last_only else x)

    def prefill_reference(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal forward of ``token_ids`` from position 0, no pool: float32 ``(T, V)``.

        The correctness yardstick for :meth:`forward`; it keeps K and V in the
        model dtype, never rounding them through a pool (window layers mask the
        window; linear layers run from the zero state).
        """
        ids = check_tokens(self.config, self.device, token_ids)
        positions = torch.arange(ids.numel(), device=self.device)
        cos, sin = self._rope(positions)
        x = self.embed.index_select(0, ids)
        cfg = self.config
        for layer, where in zip(self.layers, self._slots, strict=True):
            if where.kind == "linear":
                q, k, v = self._qkv_linear(layer, x)
                zero = torch.zeros(cfg.num_kv_heads, cfg.state_dim, cfg.head_dim,
                                   device=self.device)
                out, _, _ = recur(q.float(), k.float(), v.float(), zero, self._decay, 0)
                attn = out.reshape(len(ids), -1).to(cfg.torch_dtype)
            else:
                q, k, v = self._qkv(layer, x, cos, sin)
                window = where.kind == "window"
                attn = self._attend(
                    q, k, v, window_mask(positions, positions, cfg.window_tokens) if window else None)
            x = self._residual_mlp(layer, x, attn)
        return self._logits(x)

    __call__ = forward

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

    def _qkv_linear(
        self, layer: _Layer, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A linear layer's q (T, H, N) (scaled by N ** -0.5), k (T, KVH, N), v (T, KVH, D)."""
        cfg = self.config
        h = self._rms_norm(x, layer.attn_norm)
        n = x.shape[0]
        q = (h @ layer.wq).view(n, cfg.num_heads, cfg.state_dim) * cfg.state_dim ** -0.5
        k = (h @ layer.wk).view(n, cfg.num_kv_heads, cfg.state_dim)
        return q, k, (h @ layer.wv).view(n, cfg.num_kv_heads, cfg.head_dim)

    def _write_and_gather(
        self,
        buf: torch.Tensor,
        new: torch.Tensor,
        new_rows: torch.Tensor,
        prefix_pages: torch.Tensor,
        start_pos: int,
        first: int = 0,
    ) -> torch.Tensor:
        """Store ``new`` (T, KVH, D) at its pool rows; return K or V of positions
        ``[first, start_pos + T)``: (start_pos + T - first, KVH, D). ``prefix_pages`` are
        the pages of ``[first, start_pos)``, the first one holding position ``first``."""
        num_pages, page_size = buf.shape[0], buf.shape[1]
        stored = new.to(buf.dtype).contiguous()
        as_rows(buf, num_pages * page_size).index_copy_(0, new_rows, as_rows(stored, len(stored)))
        if first == start_pos:
            return stored.to(self.config.torch_dtype)
        # Whole pages in one gather; the last prefix page may hold new tokens too,
        # hence the slice to start_pos.
        skip = first % page_size
        prefix = buf.index_select(0, prefix_pages).flatten(0, 1)[skip : skip + start_pos - first]
        return torch.cat((prefix, stored)).to(self.config.torch_dtype)

    def _window(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
        v_buf: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor:
        """A window layer: write k, v through its page ``table`` and attend to the window."""
        page_size, window = k_buf.shape[1], self.config.window_tokens
        start, end = int(positions[0]), int(positions[-1]) + 1
        table = table.to(self.device)
        first = max(0, start - window + 1)
        pages = table[first // page_size : -(-end // page_size)]
        if bool((pages < 0).any()):
            raise ValueError(
                f"components: a window page of positions [{first}, {end}) is missing "
                f"(-1 in the window page table)")
        new_rows = table[positions // page_size] * page_size + positions % page_size
        prefix = pages[: -(-start // page_size) - first // page_size]
        k_all = self._write_and_gather(k_buf, k, new_rows, prefix, start, first)
        v_all = self._write_and_gather(v_buf, v, new_rows, prefix, start, first)
        keys = torch.arange(first, end, device=self.device)
        return self._attend(q, k_all, v_all, window_mask(positions, keys, window))

    def _linear(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
        state: StateIO, group: int, start: int,
    ) -> torch.Tensor:
        """A linear layer: its state from ``state.read`` (zeros if none), the new state to
        ``state.write`` and the checkpoints asked for; the state ``(N, KVH, D)`` takes the
        first ``N`` token rows of a page's K."""
        cfg = self.config
        n = cfg.state_dim
        if state.read is not None:
            before = k_buf[int(state.read[group]), :n].permute(1, 0, 2).float()  # (KVH, N, D)
        else:
            before = torch.zeros(cfg.num_kv_heads, n, cfg.head_dim, device=self.device)
        out, after, saved = recur(q.float(), k.float(), v.float(), before, self._decay, start,
                                  state.checkpoints.keys())
        assert state.write is not None, "checked: a running state"
        for page, value in [(state.write, after)] + [
                (state.checkpoints[p], s) for p, s in saved.items()]:
            k_buf[int(page[group]), :n] = value.permute(1, 0, 2).to(k_buf.dtype)
        return out.reshape(q.shape[0], -1).to(cfg.torch_dtype)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q (T, H, D) over k, v (L, KVH, D): (T, H*D); no mask: causal."""
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
        return attn.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)  # (T, H*D)

    def _residual_mlp(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output projection and MLP around the mixer's output: (T, hidden)."""
        x = x + attn @ layer.wo
        h = self._rms_norm(x, layer.mlp_norm)
        return x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(x, self.final_norm) @ self.lm_head).float()
