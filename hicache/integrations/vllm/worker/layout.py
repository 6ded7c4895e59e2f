"""vLLM's paged KV tensors seen as hicache pages: layouts, and the copier between them.

vLLM registers one KV tensor per attention layer. A vLLM block is one hicache
page; what a block holds in one layer is a few contiguous *planes* (runs of
bytes at a fixed stride from block to block)::

    CPU backend (fused, 4-D):   (num_blocks, H, block_size, 2 * D)  -> 1 plane per layer
    split K/V (5-D, CUDA NHD):  (2, num_blocks, block_size, H, D)   -> 2 planes: K, V
    fused K/V (5-D):            (num_blocks, 2, block_size, H, D)   -> 1 plane per layer

A host page (hicache's :class:`~hicache.memory.HostPool`, page-first) holds one
block's planes of every layer back to back, layer by layer::

    host page:  | layer 0: plane 0 | plane 1 | layer 1: plane 0 | ... |

so a host page is one contiguous block of memory (what a third tier stores),
whatever the layout. The byte order inside a plane is vLLM's: pages are only
meaningful to a vLLM of the same layout (it is part of the storage identity).

:class:`BlockCopier` has the interface of :class:`hicache.memory.PageCopier`
(``load`` / ``backup`` of a layer range), so hicache's thread and manual
executors run it unchanged. This module knows tensors and ids, not requests.
"""

from __future__ import annotations

import ctypes

import torch

from hicache.config import KVConfig
from hicache.memory import HostPool, copy_rows, load_copier, load_native_copier


def block_planes(kv: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The planes of one layer's KV tensor, each ``(num_blocks, ...)`` with a contiguous block.

    Raises ``ValueError`` for a layout that is none of those in the module docstring.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv cache: expected a tensor, got {type(kv).__name__}")
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[1] == num_blocks and num_blocks != 2:
        planes = [kv[0], kv[1]]
    elif kv.dim() >= 2 and kv.shape[0] == num_blocks:
        planes = [kv]
    else:
        raise ValueError(
            f"kv cache: expected (num_blocks={num_blocks}, ...) or (2, num_blocks={num_blocks}, "
            f"...), got shape {tuple(kv.shape)}"
        )
    for p in planes:
        if not p[0].is_contiguous():
            raise ValueError(
                f"kv cache: expected each block's data contiguous, got shape {tuple(kv.shape)} "
                f"strides {kv.stride()}"
            )
    return planes


def distinct_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int
                     ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The layers whose KV tensors hold distinct memory, and each layer's region index.

    With vLLM's hybrid KV cache manager, the layers of different KV cache groups overlay
    each other (common/groups.py): a sliding-window layer's tensor starts where a
    full-attention layer's does, a Mamba layer's state fits inside the attention block
    it shares. One region a starting address: its widest tensor stands for it (a block
    of it covers every layer's block there), and the others must fit inside (same
    block stride, at most as many bytes a block); else ``ValueError``. Without overlays
    every layer is its own region, in ``kv_caches``' order.
    """
    regions: dict[int, str] = {}  # start address -> the widest layer there
    for name, kv in kv_caches.items():
        start = kv.data_ptr() if isinstance(kv, torch.Tensor) else None
        if start is None:
            raise TypeError(f"kv cache {name!r}: expected a tensor, got {type(kv).__name__}")
        rep = regions.get(start)
        if rep is None or _row_nbytes(kv, num_blocks) > _row_nbytes(kv_caches[rep], num_blocks):
            regions[start] = name
    index = {rep: i for i, rep in enumerate(regions.values())}
    out: dict[str, int] = {}
    for name, kv in kv_caches.items():
        rep = regions[kv.data_ptr()]
        if name != rep:
            wide, rep_kv = _block_planes_bytes(kv, num_blocks), _block_planes_bytes(
                kv_caches[rep], num_blocks)
            if len(wide) > len(rep_kv) or any(
                    s != rs or n > rn for (s, n), (rs, rn) in zip(wide, rep_kv, strict=False)):
                raise ValueError(
                    f"kv caches: layers {name!r} and {rep!r} start at the same address but "
                    f"{name!r} (shape {tuple(kv.shape)}, strides {kv.stride()}) does not fit "
                    f"inside {rep!r}'s blocks (shape {tuple(kv_caches[rep].shape)})")
        out[name] = index[rep]
    return {rep: kv_caches[rep] for rep in regions.values()}, out


def _block_planes_bytes(kv: torch.Tensor, num_blocks: int) -> list[tuple[int, int]]:
    """(block stride, bytes a block) of each plane of ``kv``."""
    return [(p.stride(0) * p.element_size(), p[0].numel() * p.element_size())
            for p in block_planes(kv, num_blocks)]


def _row_nbytes(kv: torch.Tensor, num_blocks: int) -> int:
    return sum(n for _, n in _block_planes_bytes(kv, num_blocks))


class BlockLayout:
    """Planes of every layer of one worker's vLLM KV cache, and the host page they map to.

    Layers that overlay others (vLLM's hybrid KV cache manager, :func:`distinct_regions`)
    are copied once, through the layer standing for their region.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int):
        if not kv_caches:
            raise ValueError("kv caches: expected at least one layer, got none")
        kv_caches, self.region_of = distinct_regions(kv_caches, num_blocks)
        self.layer_names = list(kv_caches)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.planes = [block_planes(t, num_blocks) for t in kv_caches.values()]
        first = kv_caches[self.layer_names[0]]
        self.device = first.device
        self.dtype = first.dtype
        counts = {len(p) for p in self.planes}
        rows = {q[0].numel() * q.element_size() for p in self.planes for q in p}
        if len(counts) != 1 or len(rows) != 1:
            raise ValueError("kv caches: expected every layer to have the same shape")
        self.planes_per_layer = counts.pop()
        self.row_nbytes = rows.pop()  # bytes of one plane of one block
        self.num_layers = len(self.layer_names)
        self.layer_nbytes = self.planes_per_layer * self.row_nbytes
        self.page_nbytes = self.num_layers * self.layer_nbytes

    def host_kv_config(self) -> KVConfig:
        """A hicache :class:`KVConfig` whose page has exactly this layout's bytes per block."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_token_layer = self.layer_nbytes // self.block_size
        if per_token_layer * self.block_size != self.layer_nbytes or per_token_layer % (
            2 * itemsize
        ):
            raise ValueError(
                f"kv caches: {self.layer_nbytes} bytes per block and layer do not split into "
                f"{self.block_size} tokens of K and V in {self.dtype}"
            )
        # K and V of one token, one layer = 2 * heads * head_dim elements: any split of the
        # element count into heads x dim gives the same bytes; hicache needs only the size.
        kv = KVConfig(
            num_layers=self.num_layers, num_kv_heads=1, head_dim=per_token_layer // (2 * itemsize),
            dtype=self.dtype, page_size=self.block_size,
        )
        assert kv.page_nbytes == self.page_nbytes, "host page size must equal a block's bytes"
        return kv

    def fingerprint(self) -> str:
        """Identifies the byte layout of a page (part of the storage identity)."""
        shape = tuple(self.planes[0][0].shape[1:])
        return (
            f"vllm-L{self.num_layers}-planes{self.planes_per_layer}-"
            f"{'x'.join(map(str, shape))}-{str(self.dtype).removeprefix('torch.')}"
            f"-B{self.block_size}"
        )


class BlockPool:
    """What hicache's transfer engine needs of a device pool, over vLLM's registered KV.

    ``k_buffers`` / ``v_buffers`` are given for the split K/V layout (the CUDA
    executor copies those); other layouts are copied by :class:`BlockCopier`.
    """

    def __init__(self, layout: BlockLayout, kv: KVConfig) -> None:
        self.kv = kv
        self.num_pages = layout.num_blocks
        self.device = layout.device
        self.k_buffers: list[torch.Tensor] | None
        self.v_buffers: list[torch.Tensor] | None
        if layout.planes_per_layer == 2:
            self.k_buffers = [p[0] for p in layout.planes]
            self.v_buffers = [p[1] for p in layout.planes]
        else:
            self.k_buffers = self.v_buffers = None


class BlockCopier:
    """Copies blocks between vLLM's KV tensors (in host memory) and a host pool.

    Same interface and threading contract as :class:`hicache.memory.PageCopier`:
    ``load(host_ids, block_ids, first, last)`` and ``backup(block_ids, host_ids,
    first, last)`` move layers ``first .. last-1``. Rows move once through the
    native row copier when it builds (one ctypes call per layer range), else
    through torch ``index_select`` / ``index_copy_``.
    """

    def __init__(self, layout: BlockLayout, host_pool: HostPool, native: bool | None = None,
                 max_threads: int | None = None):
        """``max_threads``: most threads one native copy fans out to (default: torch's
        intra-op thread count)."""
        if max_threads is not None and (isinstance(max_threads, bool)
                                        or not isinstance(max_threads, int) or max_threads < 1):
            raise ValueError(f"max_threads: expected an int >= 1 or None, got {max_threads!r}")
        self.max_threads = max_threads
        if layout.device.type != "cpu":
            raise ValueError(f"kv caches: expected device 'cpu', got {layout.device}")
        if host_pool.page_nbytes != layout.page_nbytes:
            raise ValueError(
                f"host pool: expected pages of {layout.page_nbytes} bytes, got "
                f"{host_pool.page_nbytes}"
            )
        self.num_layers = layout.num_layers
        self._layout = layout
        self._host_buffer = host_pool.buffer
        strides = {q.stride(0) * q.element_size() for p in layout.planes for q in p}
        self.lib = load_native_copier() if native is not False else None
        if native and self.lib is None:
            raise RuntimeError(f"native page copier unavailable: {load_copier().reason}")
        # The native copier takes one stride per side: fall back when layers differ.
        if len(strides) != 1:
            self.lib = None
        self._block_stride = strides.pop() if len(strides) == 1 else 0
        n = self.num_layers * layout.planes_per_layer
        ptrs = ctypes.c_void_p * n
        base = host_pool.buffer.data_ptr()
        self._dev_ptrs = ptrs(*[q.data_ptr() for p in layout.planes for q in p])
        self._host_ptrs = ptrs(*[base + i * layout.row_nbytes for i in range(n)])
        # (num_blocks, row_bytes) per plane; (num_host_pages, row_bytes) per plane
        self._dev_rows = [
            [q.flatten(1).view(torch.uint8) for q in p] for p in layout.planes
        ]
        host_bytes = host_pool.buffer.view(host_pool.num_pages, -1).view(torch.uint8)
        r = layout.row_nbytes
        self._host_rows = [
            [host_bytes[:, (li * layout.planes_per_layer + j) * r:(li * layout.planes_per_layer + j + 1) * r]
             for j in range(layout.planes_per_layer)]
            for li in range(self.num_layers)
        ]

    def load(self, host_ids: torch.Tensor, block_ids: torch.Tensor, first: int, last: int):
        """Copy layers ``first .. last-1`` of host pages into vLLM blocks."""
        self._copy(block_ids, host_ids, first, last, to_blocks=True)

    def backup(self, block_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int):
        """Copy layers ``first .. last-1`` of vLLM blocks into host pages."""
        self._copy(block_ids, host_ids, first, last, to_blocks=False)

    def _copy(self, block_ids, host_ids, first: int, last: int, *, to_blocks: bool) -> None:
        assert 0 <= first <= last <= self.num_layers, (
            f"layer range [{first}, {last}) outside [0, {self.num_layers}): would copy "
            "outside the KV tensors"
        )
        num_rows = block_ids.numel()
        if num_rows == 0 or first == last:
            return
        block_ids = block_ids.contiguous()
        host_ids = host_ids.contiguous()
        lay = self._layout
        if self.lib is not None:
            if to_blocks:
                args = (self._dev_ptrs, self._host_ptrs, self._block_stride, lay.page_nbytes,
                        block_ids, host_ids)
            else:
                args = (self._host_ptrs, self._dev_ptrs, lay.page_nbytes, self._block_stride,
                        host_ids, block_ids)
            dst, src, dst_stride, src_stride, dst_ids, src_ids = args
            copy_rows(
                self.lib, dst, src, first * lay.planes_per_layer,
                (last - first) * lay.planes_per_layer, dst_stride, src_stride, lay.row_nbytes,
                dst_ids, src_ids, max_threads=self.max_threads,
            )
            return
        for li in range(first, last):
            for dev_rows, host_rows in zip(self._dev_rows[li], self._host_rows[li], strict=True):
                if to_blocks:
                    dev_rows.index_copy_(0, block_ids, host_rows.index_select(0, host_ids))
                else:
                    host_rows.index_copy_(0, host_ids, dev_rows.index_select(0, block_ids))
