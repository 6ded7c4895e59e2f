"""Page ids and the memory behind them: the page allocator, device and host KV pools, the copier.

Nothing here knows prefixes or trees: a pool maps page ids to KV rows.
"""

from hicache.memory.allocator import PageAllocator
from hicache.memory.copier import (
    PageCopier,
    copier_status,
    copy_rows,
    load_copier,
    load_native_copier,
)
from hicache.memory.pools import DevicePool, HostPool, as_rows, check_cache_memory

__all__ = [
    "DevicePool",
    "HostPool",
    "PageAllocator",
    "PageCopier",
    "as_rows",
    "check_cache_memory",
    "copier_status",
    "copy_rows",
    "load_copier",
    "load_native_copier",
]
