"""vLLM's own ``Scheduler`` / ``AsyncScheduler`` driving HiCacheConnector on a hybrid model.

:class:`HybridEngine` is :class:`vllm_sched.Engine` with several KV cache groups, vLLM's
hybrid KV cache manager on: one full-attention group and sliding-window groups
(``kind="window"``, a window of ``window`` tokens) or Mamba "align" mode groups
(``kind="state"``). Each group has one layer, and every group's layer overlays the
same KV tensor, as vLLM lays out a hybrid model's KV (block ``b`` is one group's at a
time). The formula "model" of ``vllm_sched`` per group:

- full attention: position ``p`` holds the value of the prefix ending at ``p``; a
  forward of ``[s, e)`` reads positions ``[0, s)``;
- sliding window: the same values, but a forward reads only ``[s - W + 1, s)`` (vLLM
  holds the null block 0 before that), and a read of the null block is wrong;
- state: a forward of ``[s, e)`` reads the state after ``s`` tokens from the block at
  position ``(s - 1) // B`` and writes the state after ``e`` into the block at
  ``(e - 1) // B`` (what vLLM's align mode hands over as a boundary state).

Every value is offset per group, so a block of one group loaded into another reads
wrong. Hybrid loads fail per request (vLLM recomputes or fails the request before it
runs), so every wrong read is a violation. :meth:`HybridEngine.host_page_errors` checks
every host page of every component against its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import vllm_sched
from vllm_sched import POISON, B, D, Engine, H

from hicache.tree import token_key

GROUP_OFFSET = 3_000_000  # added to the values of group g: (g + 1) * GROUP_OFFSET
MAMBA_ROW_BYTES = 400  # a Mamba layer's state bytes in a block (under its 512-byte page)


@dataclass
class HybridEngine(Engine):
    """An :class:`~vllm_sched.Engine` over a hybrid model (see the module docstring)."""

    kind: str = "window"  # "window" or "state": the groups beside full attention
    window: int = 40  # sliding window (tokens), kind "window"
    num_others: int = 1  # groups beside full attention (full attention is group 1)

    def __post_init__(self) -> None:
        self.gtables: dict[str, list[list[int]]] = {}  # per request: every group's table
        super().__post_init__()

    # ---------------------------------------------------------- configuration
    @property
    def num_groups(self) -> int:
        return self.num_others + 1

    FULL = 1  # the full-attention group's id

    def layer(self, g: int) -> str:
        return f"model.layers.{g}.self_attn.attn"

    def _cache_config(self, cls):
        config = cls(block_size=B, enable_prefix_caching=True)
        if self.kind == "state":
            config.mamba_cache_mode = "align"
            config.mamba_block_size = B
        return config

    def _groups(self) -> list:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )

        full = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
        if self.kind == "window":
            other = SlidingWindowSpec(block_size=B, num_kv_heads=H, head_size=D,
                                      dtype=torch.float32, sliding_window=self.window)
        else:
            other = MambaSpec(block_size=B, shapes=((MAMBA_ROW_BYTES // 4,),),
                              dtypes=(torch.float32,), mamba_cache_mode="align",
                              page_size_padded=full.page_size_bytes)
        return [KVCacheGroupSpec([self.layer(g)], full if g == self.FULL else other)
                for g in range(self.num_groups)]

    def _kv_tensors(self) -> dict[str, torch.Tensor]:
        shared = torch.zeros(self.num_blocks, H, B, 2 * D)
        out = {}
        for g in range(self.num_groups):
            if self.kind == "state" and g != self.FULL:
                # A Mamba layer's view: the block's first bytes, as raw bytes.
                out[self.layer(g)] = shared.view(self.num_blocks, -1).view(torch.uint8)[
                    :, :MAMBA_ROW_BYTES]
            else:
                out[self.layer(g)] = shared
        self.shared = shared
        return out

    def group_kind(self, g: int) -> str:
        return "full" if g == self.FULL else self.kind

    # ------------------------------------------------------------------ model
    def _follow_tables(self, out) -> list[tuple[str, int, int]]:
        for copy in out.kv_cache_block_copies or ():  # vLLM's copy-on-write, before the forward
            self.shared[copy.dst_block_id] = self.shared[copy.src_block_id]
        scheduled: list[tuple[str, int, int]] = []
        for new in out.scheduled_new_reqs:
            self.gtables[new.req_id] = [list(ids) for ids in new.block_ids]
            scheduled.append((new.req_id, new.num_computed_tokens,
                              out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.gtables[rid] = [list(t) for t in ids]
            elif ids is not None:
                for table, new_ids in zip(self.gtables[rid], ids, strict=True):
                    table.extend(new_ids)
            scheduled.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]))
        for rid in out.finished_req_ids:
            self.gtables.pop(rid, None)
        self.tables = {rid: t[self.FULL] for rid, t in self.gtables.items()}
        return scheduled

    def _value(self, g: int, values: np.ndarray) -> np.ndarray:
        return values + (g + 1) * GROUP_OFFSET

    def _reads(self, rid: str, done: int) -> list[tuple[int, int, int | None, float]]:
        """What a forward from token ``done`` reads: (group, block, slot or None for the
        whole block's state, expected value)."""
        if done == 0:
            return []
        values = self._expected(rid, 0, done)
        out = []
        for g, table in enumerate(self.gtables[rid]):
            kind = self.group_kind(g)
            if kind == "state":
                out.append((g, table[(done - 1) // B], None,
                            float(self._value(g, values[done - 1:done])[0])))
                continue
            first = 0 if kind == "full" else max(0, done - self.window + 1)
            want = self._value(g, values[first:done])
            out += [(g, table[p // B], p % B, float(w))
                    for p, w in zip(range(first, done), want, strict=True)]
        return out

    def _forward(self, scheduled):
        # A forward reads each request's state once, before it writes the next state
        # into the same block (within a block, align mode updates it in place): the
        # reads are taken from the blocks as they were before the forward.
        self._states_before = {block: self.shared[block, 0, 0, 0].item()
                               for rid, done, _ in scheduled
                               for _, block, slot, _ in self._reads(rid, done) if slot is None}
        try:
            return super()._forward(scheduled)
        finally:
            self._states_before = {}

    def _wrong_blocks(self, rid: str, done: int) -> set[int]:
        wrong = set()
        before = getattr(self, "_states_before", {})
        for _g, block, slot, want in self._reads(rid, done):
            got = (before[block] if slot is None and block in before
                   else self.shared[block, 0, 0 if slot is None else slot, 0].item())
            if block == 0 or got != want:
                wrong.add(block)
        return wrong

    def _compute(self, rid: str, done: int, num: int) -> bool:
        ok = not self._wrong_blocks(rid, done)
        end = done + num
        values = self._expected(rid, 0, end)
        changed = False
        for g, table in enumerate(self.gtables[rid]):
            if self.group_kind(g) == "state":
                value = float(self._value(g, values[end - 1:end])[0]) if ok else POISON
                block = table[(end - 1) // B]
                if not bool((self.shared[block] == value).all()):
                    changed = True
                self.shared[block] = value
                continue
            v = torch.tensor(self._value(g, values[done:end]) if ok else np.full(num, POISON),
                             dtype=torch.float32)
            pos = range(done, end)
            b = torch.tensor([table[p // B] for p in pos])
            s = torch.tensor([p % B for p in pos])
            if not torch.equal(self.shared[b, 0, s, 0], v):
                changed = True
            self.shared[b, :, s, :] = v[:, None, None]
        return changed

    # ----------------------------------------------------------------- checks
    def host_page_errors(self) -> list[str]:
        """Host pages the scheduler's tree holds, full and component ones (not known bad),
        whose content is not the KV (or state) of their prefix.

        A node's prefix is read off a request whose tree key runs through it (its KV
        depends on the request's inputs: images, embeddings, adapter); every node holding
        host pages must lie on one."""
        half = self.connector.scheduler_half
        comps = half.components
        pool = self.worker.worker_half.host_pool
        bad = set(half._bad) | comps._bad
        errors: list[str] = []

        def page_row(page: int) -> torch.Tensor:
            return pool.buffer[page].reshape(H, B, 2 * D)

        checked: set[int] = set()  # node ids
        for namespace, key, values in zip(self.namespaces, self.tree_keys, self.values,
                                          strict=True):
            if key is None:
                continue
            held = half.tree.probe_key(key, namespace)  # tokens of the key the tree holds
            end = 0  # tokens from the root to the node's end
            for node in half.tree.probe_path(key, namespace):
                start, end = end, end + node.num_tokens
                if end > held:  # the node runs past this key, or leaves it: another covers it
                    break
                if node.id in checked:
                    continue
                checked.add(node.id)
                errors += self._node_errors(node, start // B, end, values, bad, page_row)
        for node in half.tree.nodes():
            held = node.host_indices is not None and node.host_indices.numel() > 0
            if node.parent is not None and node.id not in checked and held:
                errors.append(f"node {node.id} lies on no request's key: not checked")
        return errors

    def _node_errors(self, node, first: int, end: int, values: np.ndarray, bad: set[int],
                     page_row) -> list[str]:
        """Errors of one node's host pages: its pages from page ``first``, its prefix
        ``end`` tokens long, ``values`` the KV of a sequence through it."""
        comps = self.connector.scheduler_half.components
        errors: list[str] = []
        pages = node.host_indices.tolist() if node.host_indices is not None else []
        for i, page in enumerate(pages):
            p = first + i
            want = self._value(self.FULL, values[p * B:(p + 1) * B])
            if page not in bad and not np.array_equal(page_row(page)[0, :, 0].double().numpy(),
                                                      want):
                errors.append(f"full page {page} (page {p}) holds wrong KV")
        for c, members in enumerate(comps.members):
            ids = node.component_pages(c, "host")
            if ids is None:
                continue
            width = len(members)
            for k, page in enumerate(ids.tolist()):
                group = members[k % width].group_id
                if page in bad:
                    continue
                if self.group_kind(group) == "state":
                    want = self._value(group, values[end - 1:end])[0]
                    got = page_row(page)[0, 0, 0].item()
                    if got != want:
                        errors.append(f"state page {page} of group {group} at "
                                      f"{end} tokens holds {got}, not {want}")
                    continue
                p = first + k // width
                want = self._value(group, values[p * B:(p + 1) * B])
                if not np.array_equal(page_row(page)[0, :, 0].double().numpy(), want):
                    errors.append(f"window page {page} of group {group} (page {p}) "
                                  "holds wrong KV")
        return errors

    def served_pages(self, tokens: list[int], namespace: str | None = None) -> int:
        """Pages of ``tokens`` the host tier would serve (every component agreeing)."""
        half = self.connector.scheduler_half
        return half.tree.probe_hit_key(token_key(np.asarray(tokens), B), namespace) // B


def hybrid_engine(**kwargs) -> HybridEngine:
    """A :class:`HybridEngine` (``vllm_sched``'s model directory is shared)."""
    vllm_sched.model_dir()
    return HybridEngine(**kwargs)
