"""The Python radix tree (the reference): page-aligned token ids, with device and host page indices per node.

What it knows: token runs, which device pages and host pages hold each run's
KV, locks, IO status, access order. What it does not know: KV tensors, streams,
allocators. It moves index tensors around and tells the caller which pages it
gave up; the caller (``HiCache``) frees them and runs the transfers.

Layout of one root-to-leaf path (device part first, then host-only part)::

    root ── A ── B ── C ── D
           |<-- on device -->|<- host only ->|
    match:  device_len = |A|+|B|,  host_len = |C|+|D|

Conventions:

* Keys are whole pages: a partial last page is never cached. Tokens are kept
  as the bytes of an int32 array, so an edge compare is one ``startswith``.
* ``device_indices`` / ``host_indices`` hold one page id per page (int64 CPU
  tensors), or ``None`` when the node has no copy in that tier.
* Invariants (checked by :meth:`RadixTree.check_integrity`): device-resident
  nodes form a connected subtree from the root; every non-root node has a copy
  somewhere; a locked node is on the device and its parent is locked at least
  as often; a node with IO in flight has both copies; size counters (and each
  node's counts of children with a host copy and of busy host children) equal
  the sums over nodes; no page id is held twice in a tier.
* Host eviction takes a host copy once no child has one: a parent on both tiers
  whose children are device-only is a candidate, and evicting a child's host
  copy makes its parent one. ``host_takeable_tokens`` is exactly what it can take.
* Namespaces (tenant, LoRA, cache salt) get separate roots: they never share nodes.
* The tree owns the page-id tensors it keeps: ``insert``, ``insert_host`` and the
  ``attach_*`` calls copy the caller's ids, so a caller reusing or re-pointing its
  tensor afterwards changes nothing in the tree.
* Hooks (``on_split``, the ``backup`` of :meth:`RadixTree.evict_device`) run in
  the middle of an operation. They may read the tree; ``backup`` may also call
  ``host_lock``, ``host_unlock``, ``attach_host``, ``set_io_status`` and
  ``evict_host`` (what a write-back backup needs). Any other tree-changing call
  from inside a hook raises ``RuntimeError`` before changing anything (the
  native tree refuses the same calls with the same words; docs/native.md). A
  hook that raises ends the operation with the tree consistent.
* Not thread-safe: one thread at a time (the native tree serialises threads).

The parts, each in its own module, bottom up (each builds on those above it)::

    node.py        TreeNode: one edge, its pages' ids in each tier, its locks
    state.py       TreeState: roots, counters, clock, heaps; live-node and hook guards
    candidates.py  which nodes each tier may evict now, and their heap entries
    kv_events.py   the KV-event log and the chained page hashes it carries
    tiers.py       lock/unlock, host locks, IO status, attaching and detaching copies
    core.py        match, probe, insert, split: the radix tree's algorithm
    eviction.py    evict_device, evict_host: giving pages up in policy order
    integrity.py   check_integrity: every invariant above, asserted
    tree.py        RadixTree: all of them, plus the path queries

and, for hybrid models, :class:`HybridRadixTree` (components beside full
attention) on top of them: :mod:`hicache.tree.python.hybrid` lists its parts.
"""

from hicache.tree.python.hybrid import HybridRadixTree
from hicache.tree.python.node import TreeNode
from hicache.tree.python.tree import RadixTree

__all__ = ["HybridRadixTree", "RadixTree", "TreeNode"]
