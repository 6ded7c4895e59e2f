"""The radix tree over page-aligned token ids, in Python (the reference) and C++.

The tree knows token keys, page ids, locks and IO status; nothing of KV tensors,
streams or storage. ``make_tree`` picks the C++ tree when it is built.
"""

from hicache.components import ComponentKind, ComponentSpec
from hicache.tree.factory import make_tree
from hicache.tree.python import HybridRadixTree, RadixTree, TreeNode
from hicache.tree.types import (
    EvictResult,
    InsertResult,
    IOStatus,
    MatchResult,
    Tier,
    TokenLike,
    token_key,
)

__all__ = [
    "ComponentKind",
    "ComponentSpec",
    "EvictResult",
    "HybridRadixTree",
    "InsertResult",
    "IOStatus",
    "MatchResult",
    "RadixTree",
    "Tier",
    "TokenLike",
    "TreeNode",
    "make_tree",
    "token_key",
]
