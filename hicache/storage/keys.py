"""Page keys for the storage tier: chained hashes of page tokens.

A page's key covers its whole prefix, so equal keys mean equal KV (for one model
layout), and the keys of a prefix are exactly the leading keys of any longer
sequence that starts with it::

    root   = H(version, namespace, fingerprint)          # the salt
    key_0  = H(root  || tokens[0 : P])
    key_1  = H(key_0 || tokens[P : 2P])
    ...                                                  # a partial last page has no key

The salt keeps tenants (namespace) and model layouts (``KVConfig.fingerprint()``)
apart. Tokens are hashed as little-endian int64 bytes whatever the input type, so
a list, an int32 array and an int64 tensor of the same ids give the same keys.

This module knows nothing about where pages are stored or what KV they hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

KEY_DIGEST_NBYTES = 16  # 32 hex characters; collisions need ~2**64 pages
KEY_HEX_LEN = 2 * KEY_DIGEST_NBYTES
_KEY_VERSION = b"hicache-page-key-v1"
_HEX_DIGITS = frozenset("0123456789abcdef")

TokenSeq = Sequence[int] | np.ndarray | torch.Tensor


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_DIGEST_NBYTES).digest()


def root_key(namespace: str | None, fingerprint: str) -> str:
    """The chain seed of one tenant and one model layout, as a hex key.

    ``namespace=None`` and ``namespace=""`` are different tenants.
    """
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace: expected str or None, got {type(namespace).__name__}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint: expected a non-empty str, got {fingerprint!r}")
    # Length-prefixed fields: no choice of strings can make two salts collide.
    parts = [_KEY_VERSION]
    ns = b"\x00" if namespace is None else b"\x01" + namespace.encode()
    for field in (ns, fingerprint.encode()):
        parts.append(len(field).to_bytes(8, "little"))
        parts.append(field)
    return _hash(b"".join(parts)).hex()


def _tokens_as_int64(tokens: TokenSeq) -> np.ndarray:
    """A 1-D little-endian int64 array of the token ids (no copy when already so)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens: expected an integer tensor, got dtype {tokens.dtype}")
        arr = tokens.detach().to("cpu", torch.int64).contiguous().numpy()
    else:
        arr = np.asarray(tokens)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
        arr = arr.astype("<i8", copy=False)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"tokens: expected non-negative ids, got min {int(arr.min())}")
    return np.ascontiguousarray(arr)


def extend_keys(prefix_key: str, tokens: TokenSeq, page_size: int) -> list[str]:
    """Keys of the whole pages of ``tokens``, continuing the chain after ``prefix_key``.

    ``prefix_key`` is a :func:`root_key` or the key of the page just before
    ``tokens``; a trailing partial page gets no key.
    """
    check_key(prefix_key)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    arr = _tokens_as_int64(tokens)
    num_pages = arr.size // page_size
    data = arr[: num_pages * page_size].tobytes()
    page_nbytes = page_size * 8
    prev = bytes.fromhex(prefix_key)
    keys = []
    for offset in range(0, num_pages * page_nbytes, page_nbytes):
        prev = _hash(prev + data[offset : offset + page_nbytes])
        keys.append(prev.hex())
    return keys


def page_keys(
    tokens: TokenSeq, page_size: int, namespace: str | None, fingerprint: str
) -> list[str]:
    """Keys of the whole pages of a token sequence from its start.

    ``page_keys(t[:n*P], ...) == page_keys(t, ...)[:n]`` for every ``n``.
    """
    return extend_keys(root_key(namespace, fingerprint), tokens, page_size)


def check_key(key: object) -> str:
    """Return ``key`` if it is a lowercase hex string of at least 32 digits, else raise."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected a hex str, got {type(key).__name__}")
    if not (KEY_HEX_LEN <= len(key) <= 128) or not _HEX_DIGITS.issuperset(key):
        raise ValueError(
            f"key: expected {KEY_HEX_LEN}..128 lowercase hex digits, got {key[:140]!r}"
        )
    return key
