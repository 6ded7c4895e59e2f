"""Verifiable KV content: every token's K and V derived from what it depends on.

A real model's KV for token ``p`` depends on the namespace (tenant, LoRA) and on
tokens ``0..p``. ``kvcheck`` fills the KV of token ``p`` with values drawn from a
seed of exactly that: a hash of ``(namespace, tokens[0..p], p)``, further mixed
with the layer, K/V plane and element index. Reading a page back and comparing
against :func:`expected_kv` then catches every way a cache can go wrong silently:

* a stale page (freed and reused by another prefix) holds another prefix's values;
* a page loaded from the wrong host page, or before the copy landed, mismatches;
* a mixed page (half old, half new; one layer loaded, the next not) mismatches
  in the affected layers;
* KV shared across namespaces mismatches, since the namespace enters the seed.

All arithmetic is vectorized numpy ``uint64`` (wrapping), one pass per call, no
Python loop per token. Values are small multiples of 1/64 in ``[-1, 1)``, then
cast to the pool dtype; comparison is bitwise on the cast values.

A hybrid model's component pages (docs/design.md, "Hybrid models: components")
are checked the same way, with a salt per component and group of layers: a window
page holds its positions' KV as above, salted; a state page holds the checkpoint
after ``L`` tokens, every slot drawn from the prefix of ``L`` tokens, salted. So a
window page or checkpoint read for the wrong prefix, group or component mismatches.

What it does not know: allocators or transfers. Callers give the page table
(device page id per page of the sequence) or host page ids; only
:func:`verify_cache` walks a cache's tree, to check every readable node at once.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from hicache.memory import DevicePool, HostPool

_U64 = np.uint64
_BASE = _U64(0x100000001B3)  # odd: powers are distinct and invertible mod 2**64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijection of uint64 with good avalanche."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def namespace_seed(namespace: str | None) -> int:
    """A 64-bit seed per namespace; ``None`` has its own."""
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace: expected str or None, got {type(namespace).__name__}")
    data = b"\x00none" if namespace is None else b"\x01" + namespace.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _as_tokens(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens: expected a 1-D integer sequence, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


def component_salt(c: int, group: int) -> int:
    """The salt of component ``c``'s group ``group`` (0 is full attention's: no salt)."""
    with np.errstate(over="ignore"):
        return int(_mix(np.array([(c + 1) * 0x10001 + group], dtype=_U64) * _GOLDEN)[0])


def position_seeds(tokens, end: int, namespace: str | None, salt: int = 0) -> np.ndarray:
    """Seed of every position ``0..end-1``: a hash of the namespace, the prefix and the position.

    The prefix hash is ``sum_i (tok_i + 1) * BASE**i`` (mod 2**64), a cumulative sum,
    so it is vectorized and still changes when any earlier token changes. ``salt``
    (:func:`component_salt`) tells a component's pages from full attention's.
    """
    toks = _as_tokens(tokens)
    if not 0 <= end <= len(toks):
        raise ValueError(f"end: expected 0 <= end <= {len(toks)}, got {end}")
    toks = toks[:end].astype(_U64)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(end, _BASE, dtype=_U64), dtype=_U64)
        prefix = np.cumsum((toks + _U64(1)) * powers, dtype=_U64)
        pos = np.arange(end, dtype=_U64)
        return _mix(prefix ^ _mix(pos * _GOLDEN + _U64(namespace_seed(namespace)) + _U64(salt)))


def expected_kv(
    seeds: np.ndarray, num_layers: int, row_numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KV of the given positions: ``(len(seeds), num_layers, 2, row_numel)`` of ``dtype``.

    ``row_numel`` is ``num_kv_heads * head_dim`` (one token's K of one layer).
    """
    n = len(seeds)
    plane = np.arange(num_layers * 2 * row_numel, dtype=_U64)
    with np.errstate(over="ignore"):
        x = _mix(seeds[:, None] + (plane[None, :] + _U64(1)) * _GOLDEN)
    # 7 bits: multiples of 1/64 in [-1, 1) are exact in float16, bfloat16 and float32.
    vals = (x >> _U64(57)).astype(np.float32) / 64.0 - 1.0
    out = torch.from_numpy(vals.reshape(n, num_layers, 2, row_numel))
    return out.to(dtype)


def _slots(page_table: torch.Tensor, start: int, end: int, page_size: int, num_pages: int):
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int64:
        raise TypeError(f"page_table: expected an int64 tensor, got {page_table!r}")
    if not 0 <= start <= end:
        raise ValueError(f"range: expected 0 <= start <= end, got [{start}, {end})")
    if -(-end // page_size) > len(page_table):
        raise ValueError(
            f"page_table: {end} tokens need {-(-end // page_size)} pages, got {len(page_table)}"
        )
    pos = torch.arange(start, end, dtype=torch.int64)
    pages = page_table.cpu()[pos // page_size]
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"page_table: ids outside [0, {num_pages})")
    return pages, pos % page_size


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison (NaN-safe, -0.0 != 0.0)."""
    size = t.element_size()
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def write_kv(
    pool: DevicePool,
    page_table: torch.Tensor,
    tokens,
    start: int,
    end: int,
    namespace: str | None = None,
    salt: int = 0,
) -> None:
    """Fill positions ``[start, end)`` of a sequence with their expected KV, all layers, K and V.

    Position ``p`` lives in device page ``page_table[p // page_size]``, slot
    ``p % page_size`` (``page_table`` as from ``PrefixHandle.page_table()``).
    """
    kv = pool.kv
    pages, slots = _slots(page_table, start, end, kv.page_size, pool.num_pages)
    if end == start:
        return
    row = kv.num_kv_heads * kv.head_dim
    vals = expected_kv(position_seeds(tokens, end, namespace, salt)[start:], kv.num_layers, row,
                       kv.torch_dtype)  # (n, L, 2, row)
    pages, slots = pages.to(pool.device), slots.to(pool.device)
    vals = vals.to(pool.device).view(len(vals), kv.num_layers, 2, kv.num_kv_heads, kv.head_dim)
    for layer in range(kv.num_layers):
        pool.k_buffers[layer][pages, slots] = vals[:, layer, 0]
        pool.v_buffers[layer][pages, slots] = vals[:, layer, 1]


def verify_kv(
    pool: DevicePool,
    page_table: torch.Tensor,
    tokens,
    end: int,
    namespace: str | None = None,
    start: int = 0,
    salt: int = 0,
) -> list[int]:
    """Positions in ``[start, end)`` whose device KV differs from the expected (any layer, K or V)."""
    kv = pool.kv
    pages, slots = _slots(page_table, start, end, kv.page_size, pool.num_pages)
    if end == start:
        return []
    row = kv.num_kv_heads * kv.head_dim
    want = expected_kv(position_seeds(tokens, end, namespace, salt)[start:], kv.num_layers, row,
                       kv.torch_dtype)  # (n, L, 2, row)
    pages, slots = pages.to(pool.device), slots.to(pool.device)
    got = torch.stack(
        [
            torch.stack([pool.k_buffers[layer][pages, slots], pool.v_buffers[layer][pages, slots]],
                        dim=1)
            for layer in range(kv.num_layers)
        ],
        dim=1,
    ).reshape(want.shape).cpu()  # (n, L, 2, row)
    bad = (_bits(got) != _bits(want)).reshape(len(want), -1).any(dim=1)
    return (torch.nonzero(bad).flatten() + start).tolist()


def verify_host_kv(
    pool: HostPool,
    host_pages: torch.Tensor,
    tokens,
    start: int,
    end: int,
    namespace: str | None = None,
    salt: int = 0,
) -> list[int]:
    """Positions in ``[start, end)`` whose host copy differs from the expected.

    ``start`` must be page-aligned: ``host_pages[j]`` holds positions
    ``start + j * page_size ..`` (a tree node's ``host_indices`` and its token range).
    """
    kv = pool.kv
    P = kv.page_size
    if start % P:
        raise ValueError(f"start: expected a multiple of page_size {P}, got {start}")
    if not isinstance(host_pages, torch.Tensor) or host_pages.dtype != torch.int64:
        raise TypeError(f"host_pages: expected an int64 tensor, got {host_pages!r}")
    num_pages = -(-(end - start) // P)
    if end < start or num_pages > len(host_pages):
        raise ValueError(
            f"range: [{start}, {end}) needs {num_pages} host pages, got {len(host_pages)}"
        )
    if end == start:
        return []
    ids = host_pages[:num_pages].cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= pool.num_pages:
        raise ValueError(f"host_pages: ids outside [0, {pool.num_pages})")
    row = kv.num_kv_heads * kv.head_dim
    want = expected_kv(position_seeds(tokens, end, namespace, salt)[start:], kv.num_layers, row,
                       kv.torch_dtype)  # (n, L, 2, row)
    # (num_pages, L, 2, P, H, D) -> (num_pages, P, L, 2, row): token-major like ``want``
    got = pool.buffer.index_select(0, ids).reshape(num_pages, kv.num_layers, 2, P, row)
    got = got.permute(0, 3, 1, 2, 4).reshape(num_pages * P, kv.num_layers, 2, row)
    got = got[: end - start]
    bad = (_bits(got) != _bits(want)).reshape(len(want), -1).any(dim=1)
    return (torch.nonzero(bad).flatten() + start).tolist()


# ----------------------------------------------------------- components
def state_seeds(tokens, length: int, namespace: str | None, salt: int, page_size: int) -> np.ndarray:
    """Seeds of the ``page_size`` slots of a checkpoint after ``length`` (>= 1) tokens."""
    base = position_seeds(tokens, length, namespace, salt)[length - 1]
    slots = np.arange(page_size, dtype=_U64)
    with np.errstate(over="ignore"):
        return _mix(base + (slots + _U64(1)) * _GOLDEN)


def _state_values(kv, tokens, length: int, namespace: str | None, salt: int) -> torch.Tensor:
    row = kv.num_kv_heads * kv.head_dim
    seeds = state_seeds(tokens, length, namespace, salt, kv.page_size)
    return expected_kv(seeds, kv.num_layers, row, kv.torch_dtype)  # (P, L, 2, row)


def write_window(pool: DevicePool, table: torch.Tensor, tokens, start: int, end: int,
                 namespace: str | None, c: int) -> None:
    """Fill positions ``[start, end)`` of window component ``c``'s pages (``table``:
    ``(num_pages, width)``, as from ``PrefixHandle.window_table``), every group salted."""
    for g in range(table.shape[1]):
        write_kv(pool, table[:, g].contiguous(), tokens, start, end, namespace,
                 component_salt(c, g))


def verify_window(pool: DevicePool, table: torch.Tensor, tokens, start: int, end: int,
                  namespace: str | None, c: int) -> list[int]:
    """Positions in ``[start, end)`` whose window pages (any group) differ from the expected."""
    bad: set[int] = set()
    for g in range(table.shape[1]):
        bad.update(verify_kv(pool, table[:, g].contiguous(), tokens, end, namespace, start,
                             component_salt(c, g)))
    return sorted(bad)


def write_state(pool: DevicePool, ids: torch.Tensor, tokens, length: int,
                namespace: str | None, c: int) -> None:
    """Fill state component ``c``'s pages ``ids`` (one per group) with the checkpoint
    after ``length`` tokens."""
    kv = pool.kv
    shape = (kv.page_size, kv.num_kv_heads, kv.head_dim)
    for g, page in enumerate(ids.tolist()):
        vals = _state_values(kv, tokens, length, namespace, component_salt(c, g)).to(pool.device)
        for layer in range(kv.num_layers):
            pool.k_buffers[layer][page] = vals[:, layer, 0].reshape(shape)
            pool.v_buffers[layer][page] = vals[:, layer, 1].reshape(shape)


def verify_state(pool: DevicePool | HostPool, ids: torch.Tensor, tokens, length: int,
                 namespace: str | None, c: int) -> bool:
    """True when pages ``ids`` (device, or host with a :class:`HostPool`) hold exactly the
    checkpoint of state component ``c`` after ``length`` tokens."""
    kv = pool.kv
    for g, page in enumerate(ids.tolist()):
        want = _state_values(kv, tokens, length, namespace, component_salt(c, g))
        if isinstance(pool, HostPool):  # (L, 2, P, H, D) -> (P, L, 2, row)
            got = pool.buffer[page].reshape(kv.num_layers, 2, kv.page_size, -1).permute(2, 0, 1, 3)
        else:
            got = torch.stack([torch.stack((pool.k_buffers[layer][page], pool.v_buffers[layer][page]))
                               for layer in range(kv.num_layers)])  # (L, 2, P, H, D)
            got = got.reshape(kv.num_layers, 2, kv.page_size, -1).permute(2, 0, 1, 3).cpu()
        if not torch.equal(_bits(got.reshape(want.shape)), _bits(want)):
            return False
    return True


def _verify_components(cache, node, tokens, start: int, end: int) -> list[str]:
    """What of ``node``'s component data, in each readable tier, differs from the expected."""
    from hicache.tree import IOStatus

    problems = []
    for c, spec in enumerate(cache.tree.components):
        for tier in ("device", "host"):
            ids = node.component_pages(c, tier)
            busy = IOStatus.LOADING if tier == "device" else IOStatus.BACKING_UP
            if ids is None or node.io_status is busy:
                continue
            pool = cache.device_pool if tier == "device" else cache.host_pool
            if not spec.is_window:
                if not verify_state(pool, ids, tokens, end, node.namespace, c):
                    problems.append(f"node {node.id} component {c} {tier} checkpoint")
                continue
            width = spec.width
            for g in range(width):
                salt = component_salt(c, g)
                if tier == "device":
                    table = torch.cat([torch.zeros(start // cache.page_size, dtype=torch.int64),
                                       ids[g::width]])
                    bad = verify_kv(pool, table, tokens, end, node.namespace, start, salt)
                else:
                    bad = verify_host_kv(pool, ids[g::width].contiguous(), tokens, start, end,
                                         node.namespace, salt)
                if bad:
                    problems.append(f"node {node.id} component {c} {tier} positions {bad}")
    return problems


def path_tokens(node) -> np.ndarray:
    """Token ids from the root of ``node``'s tree down to the end of ``node`` (int32)."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return np.frombuffer(b"".join(reversed(keys)), dtype=np.int32)


def verify_cache(cache) -> list[str]:
    """Check the KV of everything readable in ``cache``; return one line per bad node.

    Readable: the device pages of every node not being loaded, and the host pages
    of every node not being backed up (in flight, their destination is not yet
    meaningful). Empty list: every readable page holds exactly its prefix's KV.
    """
    from hicache.tree import IOStatus

    problems = []
    P = cache.page_size
    for node in cache.tree.nodes():
        tokens = path_tokens(node)
        end = len(tokens)
        start = end - node.num_tokens
        if node.on_device and node.io_status is not IOStatus.LOADING:
            table = torch.cat([torch.zeros(start // P, dtype=torch.int64), node.device_indices])
            bad = verify_kv(cache.device_pool, table, tokens, end, node.namespace, start)
            if bad:
                problems.append(f"node {node.id} ({node.namespace!r}) device positions {bad}")
        if node.on_host and node.io_status is not IOStatus.BACKING_UP:
            bad = verify_host_kv(cache.host_pool, node.host_indices, tokens, start, end,
                                 node.namespace)
            if bad:
                problems.append(f"node {node.id} ({node.namespace!r}) host positions {bad}")
        if cache.tree.components:
            problems += _verify_components(cache, node, tokens, start, end)
    return problems
