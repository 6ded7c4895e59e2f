"""The Python radix tree, whole: :class:`RadixTree`, and the queries along a path.

:class:`RadixTree` is the composition of the parts listed in
:mod:`hicache.tree.python` (each a class that adds one concept to the ones it
builds on); this module adds only the read-only queries over a root-to-node
path that a cache asks before a load or a backup. The contracts of the whole
tree are in :mod:`hicache.tree.python`'s docstring.
"""

from __future__ import annotations

import torch

from hicache.checks import check_int, check_page_tensor
from hicache.tree.guards import check_component, check_key, check_tier
from hicache.tree.python.eviction import Eviction
from hicache.tree.python.integrity import IntegrityCheck
from hicache.tree.python.node import EMPTY_PAGES, TreeNode
from hicache.tree.types import EvictResult, IOStatus, MatchResult, Tier


class RadixTree(Eviction, IntegrityCheck):
    """Radix tree with device and host indices per node (contracts: :mod:`hicache.tree.python`).

    ``RadixTree(page_size, eviction="lru", on_split=None)``: ``page_size`` tokens
    per page, the eviction policy (:class:`hicache.config.EvictionPolicy`), and
    the split hook.
    ``on_split(prefix, suffix)`` is called whenever a node is split: ``suffix``
    is the original node object (it keeps children, heap entries and identity),
    ``prefix`` the new parent holding the first part. Owners that track nodes
    with IO in flight use it to track the new node too.
    """

    def device_indices_of(self, node: TreeNode, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Device page ids of the path from the root to ``node`` (all on the device).

        With ``extra`` (1-D int64 CPU page ids) the result continues with them: a
        request's page table is ``device_indices_of(prefix_node, new_pages)``.
        """
        self._check_live(node, "device_indices_of")
        parts = [] if extra is None else [check_page_tensor("extra", extra)]
        while node.parent is not None:
            if node.device_indices is None:
                raise ValueError(f"device_indices_of: node {node.id} is not on the device")
            parts.append(node.device_indices)
            node = node.parent
        if not parts:
            return EMPTY_PAGES
        parts.reverse()
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def path_missing_host(self, node: TreeNode, min_hit_count: int = 0) -> list[TreeNode]:
        """Nodes from the root down to ``node`` that a backup would copy, root side first.

        Those on the device without a host copy, with no IO in flight and at
        least ``min_hit_count`` hits (the selective write policy's threshold).
        """
        min_hit_count = check_int("min_hit_count", min_hit_count)
        self._check_live(node, "path_missing_host")
        nodes = []
        while node.parent is not None:
            if (
                node.host_indices is None
                and node.device_indices is not None
                and node.io_status is IOStatus.NONE
                and node.hit_count >= min_hit_count
            ):
                nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def host_only_path(self, result: MatchResult) -> list[TreeNode]:
        """The host-only nodes of a match, root side first."""
        self._check_live(result.last_node, "host_only_path")
        self._check_live(result.last_device_node, "host_only_path")
        nodes = []
        node = result.last_node
        while node is not result.last_device_node:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def component_table(self, node: TreeNode, c: int, tier: Tier) -> torch.Tensor:
        """Component ``c``'s page ids in ``tier`` along the path root..``node``, per token page.

        ``-1`` where a node holds none (docs/design.md, "Hybrid models: components").
        """
        check_tier(tier, "component_table")
        check_component(c, len(self.components), "component_table")
        self._check_live(node, "component_table")
        return EMPTY_PAGES

    def component_gaps(
        self, key: bytes, c: int, tier: Tier, namespace: str | None = None
    ) -> torch.Tensor:
        """Per page of ``key``: would an insert keep ``c``'s page there, and does the tree lack it?"""
        check_tier(tier, "component_gaps")
        check_component(c, len(self.components), "component_gaps")
        return torch.zeros(len(check_key(key, self._key_nbytes_per_page)) // self._key_nbytes_per_page,
                           dtype=torch.bool)

    def attach_component(self, node: TreeNode, c: int, tier: Tier, pages: torch.Tensor) -> None:
        """Give ``node`` component ``c``'s data in ``tier`` (it holds its full copy there)."""
        check_tier(tier, "attach_component")
        check_component(c, len(self.components), "attach_component")

    def detach_component(self, node: TreeNode, c: int, tier: Tier) -> torch.Tensor:
        """Take component ``c``'s data in ``tier`` from ``node``; return its pages."""
        check_tier(tier, "detach_component")
        check_component(c, len(self.components), "detach_component")
        return EMPTY_PAGES

    def evict_component(self, c: int, tier: Tier, num_pages: int) -> EvictResult:
        """Evict component ``c``'s data in ``tier`` only (a per-component budget)."""
        check_tier(tier, "evict_component")
        check_component(c, len(self.components), "evict_component")
        return EvictResult(EMPTY_PAGES, 0, 0)

    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """Non-root nodes from the root down to ``node``."""
        self._check_live(node, "path_to")
        nodes = []
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes
