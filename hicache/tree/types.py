"""Types both radix trees share: IO status, operation results, and the token key.

A tree key is the int32 bytes of a token sequence's whole pages (a partial last
page is never cached); :func:`token_key` makes it and validates the ids. Both
the Python tree (:mod:`hicache.tree.python`) and the C++ tree
(:mod:`hicache.tree.native`) take and return these; nodes in results are the
tree's own node type (``TreeNode`` or ``NativeNode``).
"""

from __future__ import annotations

import array
from enum import Enum
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

TokenLike = list[int] | tuple[int, ...] | np.ndarray | torch.Tensor
_MAX_TOKEN = 2**31 - 1

# A tier, as component calls and KV events name it.
Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")

# The page ids of "no pages" in a result (never mutated).
NO_PAGES = torch.empty(0, dtype=torch.int64)


# One KV event a tree logs (``take_events``): (stored, tier, namespace, parent_hash,
# page hashes, num_tokens); stored is False when the pages left the tier.
TreeEvent = tuple[bool, str, str | None, int | None, list[int], int]


class IOStatus(Enum):
    NONE = 0
    LOADING = 1  # host to device copy in flight
    BACKING_UP = 2  # device to host copy in flight


# Nodes in results are the tree's own node type: TreeNode (Python) or NativeNode (C++).
class MatchResult(NamedTuple):
    device_len: int  # leading tokens whose KV is on the device
    host_len: int  # tokens after those whose KV is only in host memory
    last_device_node: Any  # deepest matched node on the device (a root if none)
    last_node: Any  # deepest matched node (ends exactly at device_len + host_len)
    # Tokens cached as full-attention pages (either tier): device_len + host_len, or more
    # where a component cannot serve a hit that long (docs/design.md, "Hybrid models").
    # A request that computes from device_len + host_len and hands the tree a state
    # checkpoint here on insert makes this prefix a hit for the next request.
    full_len: int = 0


class InsertResult(NamedTuple):
    num_cached_tokens: int  # leading tokens already on the device: their given pages were not taken
    last_node: Any  # node ending at the inserted length
    # Component page ids given to the insert that the tree did not take (the caller frees them).
    unused_pages: torch.Tensor = NO_PAGES


class EvictResult(NamedTuple):
    # Pages given up by the tree, in the evicted tier (device pages from evict_device,
    # host pages from evict_host); the caller frees them.
    page_ids: torch.Tensor
    num_evicted_tokens: int  # tokens whose pages in that tier were given up now
    num_backup_tokens: int  # tokens handed to the backup hook instead (freed when it completes)


def token_key(tokens: TokenLike, page_size: int) -> bytes:
    """The tree key of ``tokens``: int32 bytes of their whole pages (partial page dropped).

    Accepts a list/tuple of ints, an integer numpy array or an integer torch tensor.
    Raises ``TypeError`` for non-integer tokens and ``ValueError`` for ids outside
    ``[0, 2**31)``.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type == "meta":
            raise ValueError("tokens: expected a tensor with data (CPU or CUDA), got device meta")
        if tokens.layout is not torch.strided:
            raise ValueError(f"tokens: expected a dense tensor, got layout {tokens.layout}")
        if tokens.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
            raise TypeError(f"tokens: expected an integer tensor, got dtype {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D sequence, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
        n = len(tokens) // page_size * page_size
        # Every id is checked, the trailing partial page's too (it is not cached, but
        # a bad id there is the same caller mistake).
        if tokens.dtype == np.int32:
            # Every int32 id but a negative one is valid: OR them and test the sign bit.
            if len(tokens) and np.bitwise_or.reduce(tokens) < 0:
                raise ValueError(f"tokens: expected ids in [0, {_MAX_TOKEN}], got {tokens.min()}")
            return tokens[:n].tobytes()
        if len(tokens) and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN):
            raise ValueError(
                f"tokens: expected ids in [0, {_MAX_TOKEN}], got range "
                f"[{tokens.min()}, {tokens.max()}]"
            )
        return tokens[:n].astype(np.int32).tobytes()
    if not isinstance(tokens, list | tuple):
        raise TypeError(
            f"tokens: expected list, tuple, numpy array or torch tensor, got {type(tokens).__name__}"
        )
    n = len(tokens) // page_size * page_size
    try:  # every id, the trailing partial page's too
        arr = array.array("i", tokens)
    except TypeError as exc:
        raise TypeError(f"tokens: expected integer token ids ({exc})") from None
    except OverflowError:
        raise ValueError(f"tokens: expected ids in [0, {_MAX_TOKEN}]") from None
    if arr and min(arr) < 0:
        raise ValueError(f"tokens: expected ids >= 0, got {min(arr)}")
    if n != len(arr):
        del arr[n:]
    return arr.tobytes()
