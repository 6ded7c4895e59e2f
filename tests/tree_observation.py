"""What the differential tests compare between two trees (or lifecycles): the token forms
the public API accepts, a snapshot of every node, and host eviction's reach recomputed
from the nodes alone.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.tree import IOStatus

FORMS = ("list", "np32", "np64", "t32", "t64")


def as_form(tokens: list[int], form: str):
    """``tokens`` as one of the :data:`FORMS` the public API accepts."""
    if form == "np32":
        return np.array(tokens, dtype=np.int32)
    if form == "np64":
        return np.array(tokens, dtype=np.int64)
    if form == "t32":
        return torch.tensor(tokens, dtype=torch.int32)
    if form == "t64":
        return torch.tensor(tokens, dtype=torch.int64)
    return list(tokens)


def component_state(tree, node) -> list[tuple]:
    """A node's component data in both tiers and its records' stamps (hybrid trees)."""
    out = []
    for c in range(len(tree.components)):
        if hasattr(node, "_h"):  # a native node
            stamps = tuple(tree._impl.component_stamps(node._h, c))
        else:
            rec = node.components[c]
            stamps = (rec.last_access, rec.hit_count, rec.created)
        data = [node.component_pages(c, tier) for tier in ("device", "host")]
        out.append((*[None if d is None else d.tolist() for d in data], stamps))
    return out


def snapshot(tree) -> list[tuple]:
    """Everything observable about every node, in nodes() order."""
    out = []
    hybrid = bool(tree.components)
    for n in tree.nodes():
        dev = n.device_indices
        host = n.host_indices
        out.append(
            (
                n.id,
                n.parent.id,
                n.namespace,
                n.key,
                n.num_tokens,
                None if dev is None else dev.tolist(),
                None if host is None else host.tolist(),
                n.lock_ref,
                n.host_lock_ref,
                n.io_status,
                n.hit_count,
                n.last_access,
                n.created,
                n.priority,
                n.on_device,
                n.on_host,
                sorted(n.children),
                component_state(tree, n) if hybrid else None,
            )
        )
    return out


def host_takeable_by_definition(tree) -> int:
    """Host tokens host eviction can take, recomputed from the nodes alone.

    Host eviction takes a host copy once no child has one (and it is not host-locked
    and has no IO in flight). So a host copy can be taken, leaf by leaf, unless a
    host-locked copy or one with IO in flight sits in the chain of host copies below it.
    """
    def held(node) -> bool:
        if node.host_indices is None:
            return False
        if node.host_lock_ref or node.io_status is not IOStatus.NONE:
            return True
        return any(held(c) for c in node.children.values())

    return sum(n.num_tokens for n in tree.nodes() if n.host_indices is not None and not held(n))
