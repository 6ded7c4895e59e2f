"""The reference model's hybrid layers: sliding-window attention and a linear recurrence.

Both run beside full attention in a hybrid preset (:mod:`hicache.sim.modelconfig`):

* **Window attention** (Gemma, gpt-oss, Mistral-style): the token at position
  ``p`` attends to positions ``(p - W, p]``. :func:`window_mask` is the boolean mask
  of queries against the keys gathered for them (the window's pages before the
  first new token, then the new tokens).
* **Linear recurrence** (a decayed linear attention, the simplest member of the
  Mamba / linear-attention family): per KV head a state ``S`` of shape
  ``(state_dim, head_dim)`` and a fixed decay ``a``; after token ``t``,
  ``S_t = a * S_{t-1} + k_t^T v_t`` and the output is ``q_t S_t``, normalized per
  head. :func:`recur` runs ``T`` tokens from a state, chunk by chunk (chunks aligned
  to absolute positions, so every run from a checkpoint computes what a run from the
  start computes, up to float rounding), and returns the states after the
  positions asked for: the checkpoints a cache keeps.

Shapes in comments: ``T`` new tokens, ``H`` query heads, ``KVH`` KV heads, ``N`` the
state dimension, ``D`` the head dimension. Nothing here knows pools or pages: the
model reads and writes them (:mod:`hicache.sim.model`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

CHUNK = 64  # tokens per chunk of the recurrence (a (CHUNK, CHUNK) decay matrix per head)


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``(T, K)`` True where query position ``q`` may read key position ``k``: ``q - W < k <= q``."""
    diff = query_pos[:, None] - key_pos[None, :]
    return (diff >= 0) & (diff < window)


def decays(num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The fixed decay of each KV head's state: 0.75, 0.875, 0.9375, 0.96875, then again."""
    h = torch.arange(num_kv_heads, dtype=torch.float32, device=device)
    return 1.0 - torch.pow(2.0, -(2.0 + torch.remainder(h, 4)))  # (KVH,)


def recur(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    decay: torch.Tensor,
    start: int,
    checkpoints: Collection[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Run tokens at positions ``[start, start + T)`` from ``state`` (the state after ``start``).

    ``q`` (T, H, N), ``k`` (T, KVH, N), ``v`` (T, KVH, D), ``state`` (KVH, N, D),
    ``decay`` (KVH,), float32. Returns the outputs (T, H, D), the state after the last
    token and, for each ``p`` in ``checkpoints`` within ``(start, start + T]``, the
    state after ``p`` tokens.
    """
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(num_tokens, num_heads, v.shape[2], dtype=torch.float32, device=q.device)
    saved: dict[int, torch.Tensor] = {}
    wanted = sorted(p for p in checkpoints if start < p <= start + num_tokens)
    log_a = torch.log(decay)  # (KVH,)
    c0 = start
    while c0 < start + num_tokens:
        c1 = min((c0 // CHUNK + 1) * CHUNK, start + num_tokens)
        lo, hi = c0 - start, c1 - start
        qc = q[lo:hi].transpose(0, 1)  # (H, L, N)
        kc = k[lo:hi].transpose(0, 1)  # (KVH, L, N)
        vc = v[lo:hi].transpose(0, 1)  # (KVH, L, D)
        steps = torch.arange(hi - lo, dtype=torch.float32, device=q.device)
        dist = steps[:, None] - steps[None, :]  # (L, L)
        # a^(t - u) for u <= t, else 0: (KVH, L, L)
        dmat = torch.exp(log_a[:, None, None] * dist.clamp(min=0)) * (dist >= 0)
        scores = qc @ kc.repeat_interleave(group, 0).transpose(1, 2)  # (H, L, L)
        scores = scores * dmat.repeat_interleave(group, 0)
        intra = scores @ vc.repeat_interleave(group, 0)  # (H, L, D)
        carry = torch.exp(log_a[:, None] * (steps + 1)[None, :])  # (KVH, L): a^(tau + 1)
        inter = (qc @ state.repeat_interleave(group, 0)) * carry.repeat_interleave(group, 0)[..., None]
        o = intra + inter  # (H, L, D)
        out[lo:hi] = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)).transpose(0, 1)
        while wanted and wanted[0] <= c1:
            p = wanted.pop(0)
            saved[p] = _advance(state, kc[:, : p - c0], vc[:, : p - c0], log_a)
        state = _advance(state, kc, vc, log_a)
        c0 = c1
    return out, state, saved


def _advance(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """The state after the ``L`` tokens of ``k`` (KVH, L, N), ``v`` (KVH, L, D)."""
    n = k.shape[1]
    ahead = torch.arange(n - 1, -1, -1, dtype=torch.float32, device=k.device)  # L-1-u
    weight = torch.exp(log_a[:, None] * ahead[None, :])  # (KVH, L)
    grown = (k * weight[..., None]).transpose(1, 2) @ v  # (KVH, N, D)
    return torch.exp(log_a * n)[:, None, None] * state + grown
