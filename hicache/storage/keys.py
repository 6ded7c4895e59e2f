"""Page keys for the storage tier: chained hashes of page tokens.

A page's key covers its whole prefix and the model that computed it, so equal
keys mean equal KV, and the keys of a prefix are exactly the leading keys of any
longer sequence that starts with it::

    root   = H(version, namespace, fingerprint, model_id[, epoch])   # the salt
    key_0  = H(root  || tokens[0 : P])
    key_1  = H(key_0 || tokens[P : 2P])
    ...                                                     # a partial last page has no key

The salt keeps tenants (``namespace``), KV layouts (``KVConfig.fingerprint()``:
layers, KV heads, head dim, KV dtype, page size) and models (``model_id``) apart.
The layout alone is not enough: two models with the same shapes and different
weights (a fine-tune, another revision, another tensor-parallel rank's heads)
compute different KV for the same tokens. :func:`model_identity` builds a
``model_id`` from what identifies a model's KV. The tier's ``epoch``
(``StorageBackend.epoch``; salted in when > 0, so epoch 0 keeps the keys of
stores written before epochs existed) retires every page stored before a bump:
after an in-place weight update the same model name computes other KV. Tokens are hashed as
little-endian int64 bytes whatever the input type, so a list, an int32 array and
an int64 tensor of the same ids give the same keys.

This module knows nothing about where pages are stored or what KV they hold.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hicache.checks import check_int, check_model_id, check_namespace

KEY_DIGEST_NBYTES = 16  # 32 hex characters; collisions need ~2**64 pages
KEY_HEX_LEN = 2 * KEY_DIGEST_NBYTES
_KEY_VERSION = b"hicache-page-key-v2"  # v2: the salt names the model
_HEX_DIGITS = frozenset("0123456789abcdef")

TokenSeq = Sequence[int] | np.ndarray | torch.Tensor


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_DIGEST_NBYTES).digest()


def model_identity(
    name: str,
    *,
    weights_digest: str | None = None,
    revision: str | None = None,
    dtype: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    extra: Mapping[str, str] | None = None,
) -> str:
    """A ``model_id`` for :func:`root_key`: one canonical string per model whose KV differs.

    ``name`` is the model's name or path; ``weights_digest`` (a hash of the weights)
    or ``revision`` (an immutable checkpoint revision) says which weights, at least
    one is required; ``dtype`` is the compute dtype (it changes the KV even when the
    KV is stored in another dtype); ``tp_rank``/``tp_size`` name the slice of KV heads
    a tensor-parallel rank holds; ``extra`` carries anything else that changes the KV
    (RoPE scaling, quantization recipe ...). Equal inputs give equal strings in any
    process; any differing field gives a different string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    if weights_digest is None and revision is None:
        raise ValueError(
            "model_identity: expected weights_digest or revision (which weights computed "
            "the KV), got neither"
        )
    fields: dict[str, object] = {"name": name}
    for field_name, value in (
        ("weights_digest", weights_digest), ("revision", revision), ("dtype", dtype)
    ):
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{field_name}: expected a non-empty str, got {value!r}")
            fields[field_name] = value
    tp_rank = check_int("tp_rank", tp_rank)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
    fields["tp"] = [tp_rank, tp_size]
    if extra:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise TypeError(f"extra: expected a mapping of str to str, got {dict(extra)!r}")
        fields["extra"] = dict(extra)
    # JSON with sorted keys: canonical, and no choice of strings makes two fields collide.
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def root_key(namespace: str | None, fingerprint: str, model_id: str, *, epoch: int = 0) -> str:
    """The chain seed of one tenant, one KV layout, one model and one storage epoch,
    as a hex key.

    ``namespace=None`` and ``namespace=""`` are different tenants. ``epoch`` is the
    tier's (``StorageBackend.epoch``): keys of different epochs never meet.
    """
    check_namespace(namespace)
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint: expected a non-empty str, got {fingerprint!r}")
    check_model_id(model_id)
    epoch = check_int("epoch", epoch)
    # Length-prefixed fields: no choice of strings can make two salts collide (and a
    # salt with an epoch has one field more than one without).
    parts = [_KEY_VERSION]
    ns = b"\x00" if namespace is None else b"\x01" + namespace.encode()
    fields = [ns, fingerprint.encode(), model_id.encode()]
    if epoch:
        fields.append(b"epoch:%d" % epoch)
    for field in fields:
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
    page_size = check_int("page_size", page_size, minimum=1)
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
    tokens: TokenSeq, page_size: int, namespace: str | None, fingerprint: str, model_id: str,
    *, epoch: int = 0,
) -> list[str]:
    """Keys of the whole pages of a token sequence from its start.

    ``page_keys(t[:n*P], ...) == page_keys(t, ...)[:n]`` for every ``n``.
    """
    return extend_keys(root_key(namespace, fingerprint, model_id, epoch=epoch), tokens,
                       page_size)


def check_key(key: object) -> str:
    """Return ``key`` if it is a lowercase hex string of at least 32 digits, else raise."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected a hex str, got {type(key).__name__}")
    if not (KEY_HEX_LEN <= len(key) <= 128) or not _HEX_DIGITS.issuperset(key):
        raise ValueError(
            f"key: expected {KEY_HEX_LEN}..128 lowercase hex digits, got {key[:140]!r}"
        )
    return key
