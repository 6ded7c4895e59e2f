"""The page ids of a run of nodes, in one tensor (what one transfer moves).

A load, a backup or a storage write moves the pages of several nodes at once;
the caller has chosen nodes that hold a copy in the tier it reads. These
functions concatenate those copies in node order, and raise ``ValueError``
naming the first node without one (a caller's bookkeeping error, not a state
the cache can recover from). Works on both trees' nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.tree.protocol import NodeLike


def device_pages_of(nodes: Sequence[NodeLike]) -> torch.Tensor:
    """The device page ids of ``nodes``, in order (each node is on the device)."""
    return torch.cat([_copy_of(n, n.device_indices, "device") for n in nodes])


def host_pages_of(nodes: Sequence[NodeLike]) -> torch.Tensor:
    """The host page ids of ``nodes``, in order (each node has a host copy)."""
    return torch.cat([_copy_of(n, n.host_indices, "host") for n in nodes])


def _copy_of(node: NodeLike, pages: torch.Tensor | None, tier: str) -> torch.Tensor:
    if pages is None:
        raise ValueError(f"expected nodes with a {tier} copy, got {node!r}")
    return pages
