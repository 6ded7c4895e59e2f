"""The component half of the native tree's wrapper (hybrid models).

:class:`NativeComponents` is the part of :class:`hicache.tree.native.NativeRadixTree`
that speaks of components (docs/design.md, "Hybrid models: components"): inserts
with component pages, a match's ``full_len``, the reads, attaching and detaching a
node's component data, and the counters. It checks arguments as the Python tree
does (:mod:`hicache.tree.guards`), then relays to the binding. A single-kind tree
(no components) refuses every component index and takes the binding's fast paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache.checks import check_int, check_page_count, check_page_tensor
from hicache.components import ComponentSpec
from hicache.native.binding import TreeBinding
from hicache.tree.guards import check_component, check_component_pages, check_key, check_tier
from hicache.tree.native_node import NativeNode
from hicache.tree.python.hybrid_paths import gaps_along
from hicache.tree.python.hybrid_records import kind_logic
from hicache.tree.types import EvictResult, InsertResult, MatchResult, Tier, TokenLike, token_key

_MAX_COUNT = 2**62  # larger eviction requests mean "everything" (as in hicache.tree.native)


class NativeComponents:
    """Component calls of the native tree (see the module docstring)."""

    page_size: int
    _impl: TreeBinding
    components: tuple[ComponentSpec, ...] = ()

    if TYPE_CHECKING:  # NativeRadixTree's
        def _node(self, handle: int) -> NativeNode: ...
        def _handle(self, node: object, op: str) -> int: ...

    @property
    def device_component_evictable_pages(self) -> int:
        """Component page ids on unlocked device nodes (all components)."""
        return self._impl.device_component_evictable_pages

    @property
    def host_component_takeable_pages(self) -> int:
        """Component page ids ``evict_host`` can take now (all components)."""
        return self._impl.host_component_takeable_pages

    def num_component_pages(self, c: int, tier: Tier) -> int:
        """Page ids component ``c`` holds in ``tier``."""
        check_tier(tier, "num_component_pages")
        check_component(c, len(self.components), "num_component_pages")
        return self._impl.num_component_pages(c, tier == "host")

    def _match_components(self, arg: object, namespace: str | None) -> MatchResult:
        """A match of a hybrid tree: cut to what every component serves (``full_len``)."""
        device_len, host_len, last_device, last, full_len = self._impl.match_full(arg, namespace)
        node = self._node
        return MatchResult(device_len, host_len, node(last_device), node(last), full_len)

    def _insert_components(
        self, tokens: TokenLike | bytes, pages: torch.Tensor, namespace: str | None,
        components: Sequence[torch.Tensor | None], *, host: bool,
    ) -> InsertResult:
        """An insert (``host``: insert_host) of a hybrid tree, with its component pages."""
        if isinstance(tokens, bytes):
            key = check_key(tokens, 4 * self.page_size)
        else:
            key = token_key(tokens, self.page_size)
        num_pages = len(key) // (4 * self.page_size)
        check_page_count("host_indices" if host else "device_indices", pages, num_pages)
        given = check_component_pages(components, [s.width for s in self.components], num_pages)
        call = self._impl.insert_host_components if host else self._impl.insert_components
        num_cached, last, unused = call(key, pages, namespace, list(given))
        return InsertResult(num_cached, self._node(last), unused)

    def _check_component_pages(self, components: Sequence[torch.Tensor | None]) -> None:
        """A single-kind tree takes no component pages."""
        check_component_pages(components, [s.width for s in self.components], 0)

    def probe_hit_key(self, key: bytes, namespace: str | None = None) -> int:
        """Tokens of ``key`` a match would serve (``device_len + host_len``), read-only."""
        key = check_key(key, 4 * self.page_size)
        if namespace is not None and not isinstance(namespace, str):
            hash(namespace)  # an unhashable namespace raises TypeError, as a dict lookup does
        if not self.components:
            return self._impl.probe(key, namespace)
        return self._impl.probe_hit(key, namespace)

    def component_table(self, node: NativeNode, c: int, tier: Tier) -> torch.Tensor:
        """Component ``c``'s pages along the path; see :meth:`RadixTree.component_table`."""
        check_tier(tier, "component_table")
        check_component(c, len(self.components), "component_table")
        return self._impl.component_table(self._handle(node, "component_table"), c, tier == "host")

    def component_gaps(
        self, key: bytes, c: int, tier: Tier, namespace: str | None = None
    ) -> torch.Tensor:
        """Pages an insert would keep and the tree lacks; see :meth:`RadixTree.component_gaps`."""
        check_tier(tier, "component_gaps")
        check_component(c, len(self.components), "component_gaps")
        key = check_key(key, 4 * self.page_size)
        logic = kind_logic(self.components[c], self.page_size)
        return gaps_along(self, logic, key, c, tier, namespace)  # type: ignore[arg-type]

    def attach_component(self, node: NativeNode, c: int, tier: Tier, pages: torch.Tensor) -> None:
        """Give ``node`` component data; see :meth:`RadixTree.attach_component`."""
        check_tier(tier, "attach_component")
        check_component(c, len(self.components), "attach_component")
        handle = self._handle(node, "attach_component")
        self._impl.attach_component(handle, c, tier == "host", check_page_tensor("pages", pages))

    def evict_component(self, c: int, tier: Tier, num_pages: int) -> EvictResult:
        """Evict component ``c``'s data only; see :meth:`HybridRadixTree.evict_component`."""
        check_tier(tier, "evict_component")
        check_component(c, len(self.components), "evict_component")
        # (clamped as evict_device / evict_host are: a huge count means everything)
        num_pages = min(check_int("num_pages", num_pages), _MAX_COUNT)
        if not self.components:
            return EvictResult(torch.empty(0, dtype=torch.int64), 0, 0)
        return EvictResult(*self._impl.evict_component(c, tier == "host", num_pages))

    def detach_component(self, node: NativeNode, c: int, tier: Tier) -> torch.Tensor:
        """Take ``node``'s component data; see :meth:`RadixTree.detach_component`."""
        check_tier(tier, "detach_component")
        check_component(c, len(self.components), "detach_component")
        return self._impl.detach_component(self._handle(node, "detach_component"), c, tier == "host")

