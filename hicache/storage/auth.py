"""The storage secret: a keyed authenticator over each stored page's key and bytes.

Page keys are derived from public facts (model identity, token ids) and the
value checksum (crc32) catches corruption, not forgery: anyone who can write
into the store can file KV under the keys other caches look up. With a storage
secret, every value carries a tag, HMAC-SHA256 over the page key, the payload
length and the payload bytes, under a key derived from the secret. A reader with
the secret serves only pages whose tag verifies; anything else is a miss
(counted in ``num_unauthentic_values``). The tag covers the page bytes
themselves: a MAC over a non-cryptographic checksum could be defeated by a
checksum collision.

The secret comes from the ``storage_secret`` option (``CacheConfig.storage_secret``,
the vLLM connector's ``storage_secret``) or, when that is not given, from the
``HICACHE_STORAGE_SECRET`` environment variable. It is never logged, never part
of a repr or an error message; only a derived key is kept.

Cost: one HMAC-SHA256 pass over the page per write and per read (OpenSSL,
1.8 GB/s per core with SHA extensions, see docs/benchmarks.md). It runs inside
the backend's ``set``/``get_into``, which the storage worker threads call, and
hashlib releases the GIL while hashing large buffers.

This module knows nothing about backends, files or the cache.
"""

from __future__ import annotations

import hmac
import os

from hicache.checks import check_secret

SECRET_ENV = "HICACHE_STORAGE_SECRET"
TAG_NBYTES = 32
_KDF_LABEL = b"hicache storage page authenticator v1"


class PageAuthenticator:
    """Tags and verifies stored values under one storage secret. Thread-safe (stateless)."""

    __slots__ = ("_mac_key",)

    def __init__(self, secret: str | bytes) -> None:
        checked = check_secret("storage_secret", secret)
        if checked is None:
            raise ValueError("storage_secret: expected a non-empty str or bytes, got None")
        raw = checked.encode() if isinstance(checked, str) else bytes(checked)
        # A derived key: the secret itself is not kept, and tags under another label
        # (a future format) never verify as these.
        self._mac_key = hmac.digest(raw, _KDF_LABEL, "sha256")

    def __repr__(self) -> str:
        return "PageAuthenticator(<secret>)"

    def tag(self, key: str, payload: memoryview) -> bytes:
        """The 32-byte tag of ``payload`` stored under ``key``."""
        mac = hmac.new(self._mac_key, digestmod="sha256")
        encoded = key.encode()
        # Length-prefixed fields: no (key, payload) pair reads as another.
        mac.update(len(encoded).to_bytes(8, "little") + encoded)
        mac.update(len(payload).to_bytes(8, "little"))
        mac.update(payload)  # OpenSSL, GIL released for large buffers
        return mac.digest()

    def verify(self, key: str, payload: memoryview, tag: bytes | memoryview) -> bool:
        """True when ``tag`` is the tag of ``payload`` under ``key`` (constant-time compare)."""
        return hmac.compare_digest(self.tag(key, payload), bytes(tag))


def authenticator_for(secret: str | bytes | None) -> PageAuthenticator | None:
    """The authenticator for ``secret``, or for ``$HICACHE_STORAGE_SECRET`` when ``secret``
    is None; None when neither is set (an empty variable counts as unset)."""
    secret = check_secret("storage_secret", secret)
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    return None if secret is None else PageAuthenticator(secret)
