"""The component half of the native tree's wrapper (hybrid models).

:class:`NativeComponents` is the part of :class:`hicache.tree.native.NativeRadixTree`
that speaks of components (docs/design.md, "Hybrid models: components"): the
calls that read, attach and detach a node's component data, and the counters.
It relays them to the binding with the arguments checked as the Python tree
checks them (:mod:`hicache.tree.python`). It knows nothing of match or eviction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.components import ComponentSpec
from hicache.tree.guards import check_component, check_key, check_tier
from hicache.tree.native_node import NativeNode
from hicache.tree.types import Tier


class NativeComponents:
    """Component calls of the native tree (see the module docstring)."""

    page_size: int
    components: tuple[ComponentSpec, ...] = ()
    device_component_evictable_pages = 0  # component ids on unlocked device nodes
    host_component_takeable_pages = 0  # component ids evict_host can take now

    def num_component_pages(self, c: int, tier: Tier) -> int:
        """Page ids component ``c`` holds in ``tier``."""
        check_tier(tier, "num_component_pages")
        check_component(c, len(self.components), "num_component_pages")
        return 0

    def _check_component_pages(self, components: Sequence[torch.Tensor | None]) -> None:
        if len(components) != len(self.components):
            raise ValueError(
                f"components: expected one entry per component of the tree "
                f"({len(self.components)}), got {len(components)}"
            )

    def component_table(self, node: NativeNode, c: int, tier: Tier) -> torch.Tensor:
        """Component ``c``'s pages along the path; see :meth:`RadixTree.component_table`."""
        check_tier(tier, "component_table")
        check_component(c, len(self.components), "component_table")
        return torch.empty(0, dtype=torch.int64)

    def component_gaps(
        self, key: bytes, c: int, tier: Tier, namespace: str | None = None
    ) -> torch.Tensor:
        """Pages an insert would keep and the tree lacks; see :meth:`RadixTree.component_gaps`."""
        check_tier(tier, "component_gaps")
        check_component(c, len(self.components), "component_gaps")
        num_pages = len(check_key(key, 4 * self.page_size)) // (4 * self.page_size)
        return torch.zeros(num_pages, dtype=torch.bool)

    def attach_component(self, node: NativeNode, c: int, tier: Tier, pages: torch.Tensor) -> None:
        """Give ``node`` component data; see :meth:`RadixTree.attach_component`."""
        check_tier(tier, "attach_component")
        check_component(c, len(self.components), "attach_component")

    def detach_component(self, node: NativeNode, c: int, tier: Tier) -> torch.Tensor:
        """Take ``node``'s component data; see :meth:`RadixTree.detach_component`."""
        check_tier(tier, "detach_component")
        check_component(c, len(self.components), "detach_component")
        return torch.empty(0, dtype=torch.int64)
