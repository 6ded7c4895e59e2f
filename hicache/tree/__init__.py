"""The radix tree over page-aligned token ids, in Python (the reference) and C++.

The tree knows token keys, page ids, locks and IO status; nothing of KV tensors,
streams or storage. ``make_tree`` picks the C++ tree when it is built.
"""

from hicache.tree.python import (
    EvictResult,
    InsertResult,
    IOStatus,
    MatchResult,
    RadixTree,
    TokenLike,
    TreeNode,
    token_key,
)

__all__ = [
    "EvictResult",
    "InsertResult",
    "IOStatus",
    "MatchResult",
    "RadixTree",
    "TokenLike",
    "TreeNode",
    "token_key",
]
