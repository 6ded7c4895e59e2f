"""A hybrid model's component data in the cache's transfers, and each component's budget.

Component pages share the tiers' page space with full-attention pages
(docs/design.md, "Hybrid models: components"), so a load or a backup of a node
moves its component pages in the same transfer as its full pages:

* a load of host-only nodes gives each node, beside its full pages, device pages
  for the component data its host copy holds (:func:`attach_loaded`);
* a backup gives a node's host copy the component data its device copy holds, or
  only that when the host copy exists already (:func:`backup_plan`);
* :func:`transfer_pairs` lists, node by node, the device and host page ids one
  transfer copies (full pages, then each component held in both tiers).

:class:`ComponentBudget` keeps each component within its share of a tier
(``CacheConfig.component_device_fraction`` / ``component_host_fraction``) by
evicting that component's least recently used data. Nothing here knows requests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from hicache.tree.protocol import NodeLike, RadixTreeLike
    from hicache.tree.types import Tier


def component_pages(node: NodeLike, tier: Tier, num_components: int) -> list[torch.Tensor]:
    """``node``'s component page ids in ``tier``, component by component (held ones only)."""
    out = []
    for c in range(num_components):
        ids = node.component_pages(c, tier)
        if ids is not None:
            out.append(ids)
    return out


def load_extra_pages(nodes: Sequence[NodeLike], num_components: int) -> int:
    """Device pages a load of ``nodes`` takes beside their full pages (their host components)."""
    return sum(t.shape[0] for n in nodes for t in component_pages(n, "host", num_components))


def attach_loaded(
    tree: RadixTreeLike, node: NodeLike, pages: torch.Tensor, off: int, num_components: int
) -> int:
    """Give ``node`` (just attached on the device) device pages ``pages[off:]`` for each
    component its host copy holds; return the offset past them."""
    for c in range(num_components):
        host = node.component_pages(c, "host")
        if host is not None:
            n = host.shape[0]
            tree.attach_component(node, c, "device", pages[off : off + n])
            off += n
    return off


def backup_plan(node: NodeLike, num_components: int) -> tuple[bool, list[int], int]:
    """What a backup of ``node`` copies: (its full pages?, the components, host pages needed).

    Full pages when the node has no host copy; the components whose data its device
    copy holds and its host copy lacks.
    """
    full = node.host_indices is None
    num_pages = node.device_indices.shape[0] if full and node.device_indices is not None else 0
    comps = []
    for c in range(num_components):
        device = node.component_pages(c, "device")
        if device is not None and node.component_pages(c, "host") is None:
            comps.append(c)
            num_pages += device.shape[0]
    return full, comps, num_pages


def transfer_pairs(
    nodes: Sequence[Any], num_components: int, parts: Mapping[Any, list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device and host page ids one transfer of ``nodes`` copies, in node order.

    Each node's full pages, then each component held in both tiers; a node in
    ``parts`` moves only those components (a backup of component data alone). No
    nodes (or nothing held in both tiers): two empty tensors.
    """
    device: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    for node in nodes:
        only = None if parts is None else parts.get(node)
        if only is None:
            assert node.device_indices is not None and node.host_indices is not None, (
                "a transfer moves nodes on both tiers")
            device.append(node.device_indices)
            host.append(node.host_indices)
        for c in range(num_components) if only is None else only:
            d, h = node.component_pages(c, "device"), node.component_pages(c, "host")
            if d is not None and h is not None:
                device.append(d)
                host.append(h)
    if not device:  # (issue 45, case 4: a bookkeeping backup of the evicted leaf alone)
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(device), torch.cat(host)


class ComponentBudget:
    """Keeps each component of a tree within its share of each tier (module docstring)."""

    def __init__(self, tree: RadixTreeLike, caps: dict[str, int],
                 free: dict[str, Callable[[torch.Tensor], None]]) -> None:
        self._tree = tree
        self._caps = caps  # tier -> page ids each component may hold
        self._free = free  # tier -> the allocator's free

    def enforce(self, tier: Tier) -> int:
        """Evict what each component holds past its cap in ``tier``; the page ids freed."""
        cap = self._caps[tier]
        freed = 0
        for c in range(len(self._tree.components)):
            over = self._tree.num_component_pages(c, tier) - cap
            if over > 0:
                result = self._tree.evict_component(c, tier, over)
                if result.page_ids.shape[0]:
                    self._free[tier](result.page_ids)
                    freed += result.page_ids.shape[0]
        return freed
