"""Host pages the workers reported bad, as the scheduler half keeps them.

A page is *bad* when its content is not what the tree says (its save or third-tier
read failed, or the save was dropped). It stays in the tree (the next request that
computes those blocks saves them into it again), but lookups stop before it. Only
cached pages are kept: a report about a page that has left the tree meanwhile (evicted,
or a prefetch's page that never went in) says nothing about its next use.
"""

from __future__ import annotations

import torch


class BadPages(set):
    """A set of host page ids, with the two questions the scheduler half asks of it."""

    def report(self, host_pages, tree) -> None:
        """The workers found ``host_pages`` bad: keep those the tree holds."""
        self.update(int(p) for p in host_pages)
        cached = {int(p) for n in tree.nodes() if n.host_indices is not None
                  for p in n.host_indices.tolist()}
        self.intersection_update(cached)

    def first(self, tree, key: bytes, namespace: str | None, num_pages: int) -> int:
        """Index of the first bad page among the first ``num_pages`` cached pages of
        ``key`` (``num_pages`` when none is bad)."""
        if not self or num_pages == 0:
            return num_pages
        path = tree.probe_path(key, namespace)
        ids = torch.cat([node.host_indices for node in path]).tolist()[:num_pages]
        for i, page in enumerate(ids):
            if page in self:
                return i
        return num_pages
