"""CacheStats: the cache's exact counters, and the stats() report built from them.

The counters are plain integers (and seconds) that the parts of the cache add to
as they work; :func:`stats_report` adds the derived ratios and bandwidths, and
:func:`tier_occupancy` reads what each tier holds now. Nothing here knows the tree
or the free lists beyond the counts they report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from hicache.memory import PageAllocator
    from hicache.tree.protocol import RadixTreeLike


@dataclass
class CacheStats:
    """Counters since construction; exact, in tokens unless the name says otherwise."""

    requests: int = 0  # match calls
    requested_tokens: int = 0  # tokens passed to match
    device_hit_tokens: int = 0  # matched on the device
    host_hit_tokens: int = 0  # matched in host memory and loaded back
    host_hit_refused_tokens: int = 0  # host hits not loaded (below threshold or no room)
    loads_refused_by_threshold: int = 0
    loads_refused_no_space: int = 0
    loads: int = 0
    loads_failed: int = 0
    loads_reloaded: int = 0  # failed loads' nodes loaded again in place (a request held them)
    load_bytes: int = 0
    load_seconds: float = 0.0
    backups: int = 0
    backups_failed: int = 0
    backups_skipped: int = 0  # nodes not backed up: host tier full and nothing evictable
    backups_retried: int = 0  # failed backups started again (a child's host copy needs them)
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    device_evicted_tokens: int = 0
    # device tokens dropped with no host copy because write-back backups kept failing
    # (also in device_evicted_tokens); recomputed when requested again
    unbacked_dropped_tokens: int = 0
    host_evicted_tokens: int = 0
    inserted_tokens: int = 0  # tokens newly cached by insert
    storage_prefetches: int = 0  # reads from the third tier started
    storage_hit_tokens: int = 0  # tokens brought into the host tier from storage
    storage_read_bytes: int = 0
    storage_read_seconds: float = 0.0
    storage_writes: int = 0  # writes to the third tier started
    storage_write_bytes: int = 0
    storage_write_seconds: float = 0.0
    storage_errors: int = 0  # failed storage jobs (store unreachable, I/O error)
    # pages read from storage whose tag did not verify under the storage secret (misses)
    storage_unauthentic_pages: int = 0
    pins_refused: int = 0  # pin calls refused: the pin budget (max_pinned_fraction) was spent


def stats_report(c: CacheStats) -> dict[str, Any]:
    """``c`` as a dict, plus hit totals and ratio and the load/backup bandwidths (GB/s)."""
    s = asdict(c)
    s["hit_tokens"] = c.device_hit_tokens + c.host_hit_tokens
    s["hit_ratio"] = s["hit_tokens"] / c.requested_tokens if c.requested_tokens else 0.0
    s["load_gbps"] = c.load_bytes / c.load_seconds / 1e9 if c.load_seconds else 0.0
    s["backup_gbps"] = c.backup_bytes / c.backup_seconds / 1e9 if c.backup_seconds else 0.0
    return s


def tier_occupancy(
    tree: RadixTreeLike, device_allocator: PageAllocator, host_allocator: PageAllocator
) -> dict[str, Any]:
    """Pages used and free in each tier's free list, tokens cached in each tier now; for a
    hybrid model the page ids its components hold in each tier (in all, and each one's)."""
    out: dict[str, Any] = {
        "device_pages_used": device_allocator.num_used_pages,
        "device_pages_free": device_allocator.num_free_pages,
        "host_pages_used": host_allocator.num_used_pages,
        "host_pages_free": host_allocator.num_free_pages,
        "device_cached_tokens": tree.device_tokens,
        "host_cached_tokens": tree.host_tokens,
    }
    if tree.components:
        per = [{"component": spec.describe(),
                "device_pages": tree.num_component_pages(c, "device"),
                "host_pages": tree.num_component_pages(c, "host")}
               for c, spec in enumerate(tree.components)]
        out["device_component_pages"] = sum(p["device_pages"] for p in per)
        out["host_component_pages"] = sum(p["host_pages"] for p in per)
        out["components"] = per
    return out
