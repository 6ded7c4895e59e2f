"""What a request's KV depends on besides its token ids, and how hicache keys it.

vLLM's block hash chains a block's token ids with *extra keys*
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``): the LoRA
adapter, the multimodal items overlapping the block (``("mm", identifier, offset)``,
the identifier being the item's content hash), the digest of the block's prompt
embeddings (``("prompt_embeds", sha256)``) and ``cache_salt`` on the first block.
hicache keys its pages by token ids (the radix tree, the third tier's chained keys),
so it carries the same distinctions:

* **LoRA**: the adapter is part of the request's namespace, as its name and a digest
  of its files (:class:`AdapterDigests`): two adapters registered under one name (on
  two instances, or replaced in place) never share, and the base model is a
  namespace of its own.
* **Multimodal items, prompt embeddings**: position-level. A page that overlaps one
  is keyed by *identity ids*: its token ids replaced by values derived from them and
  from vLLM's extra keys of the page (as SGLang's radix cache pads multimodal
  placeholders with values derived from each item's hash)::

      tokens:       | text | text | txt [img img | img img | img] txt | text |
      identity ids: | text | text |   derived    | derived |  derived  | text |
                    ^ shared with text prompts  ^ only with the same image here

  Pages before the first such position still share with plain-text prompts; a page
  from it on only with prompts carrying the same inputs at the same positions (the
  keys chain: every later page differs too).
* **Anything else** vLLM puts in a block's extra keys (a kind this module does not
  know) refuses the request: served by vLLM alone, nothing loaded or saved; never a
  guess.

Identity ids lie in ``[2**30, 2**31)``, above every vocabulary, so a derived page never
equals a text page; each of its positions carries 30 bits of a SHA-256 digest of the
page's tokens and inputs. vLLM is imported only by :func:`read_inputs`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

# Extra-key kinds (the first field of each of vLLM 0.32's extra keys): those the
# namespace carries, those keyed position by position.
NAMESPACE_KINDS = frozenset({"lora", "cache_salt"})
POSITION_KINDS = frozenset({"mm", "prompt_embeds"})
DERIVED_BASE = 1 << 30  # identity ids are DERIVED_BASE + 30 bits
_DOMAIN = b"hicache-page-inputs-v1\x00"
_log = logging.getLogger("hicache.integrations.vllm.scheduler")


class RequestInputs(NamedTuple):
    """A request's inputs besides its token ids, as hicache keys them."""

    adapter: str | None = None  # the LoRA adapter ("name@sha256"), part of the namespace
    pages: Mapping[int, bytes] = {}  # page index -> digest of vLLM's extra keys of that page
    refused: str | None = None  # an input hicache cannot key: served without hicache


class UnkeyedInput(Exception):
    """An input kind hicache cannot key; ``kind`` names it (logged once per kind)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def read_inputs(request: Request, page_size: int, adapters: AdapterDigests) -> RequestInputs:
    """The inputs of ``request`` (vLLM's ``Request``) besides its token ids, from vLLM's
    own extra keys of each prompt page. Never raises: an input it cannot key gives
    ``refused`` (the kind) instead."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    adapter = None
    try:
        if request.lora_request is not None:
            adapter = adapters.identity(request.lora_request)
        # Pages past the prompt carry no multimodal item or prompt embedding: only the
        # prompt's pages (and the first one, which names every request-level kind).
        positional = bool(request.mm_features) or request.prompt_embeds is not None
        num_pages = -(-request.num_prompt_tokens // page_size) if positional else 1
        pages: dict[int, bytes] = {}
        mm_idx = 0
        for i in range(max(1, num_pages)):
            keys, mm_idx = generate_block_hash_extra_keys(
                request, i * page_size, (i + 1) * page_size, mm_idx)
            digest = page_digest(keys or ())
            if digest is not None:
                pages[i] = digest
    except UnkeyedInput as exc:
        return RequestInputs(refused=exc.kind)
    return RequestInputs(adapter, pages)


def page_digest(extra_keys: Sequence[Any]) -> bytes | None:
    """SHA-256 of a page's position-level extra keys (None when it has none); raises
    :class:`UnkeyedInput` for a kind not known here."""
    h = None
    for key in extra_keys:
        if not (isinstance(key, tuple) and key and isinstance(key[0], str)):
            raise UnkeyedInput(f"extra key {type(key).__name__}")
        kind = key[0]
        if kind in NAMESPACE_KINDS:
            continue
        if kind not in POSITION_KINDS:
            raise UnkeyedInput(kind)
        h = h or hashlib.sha256()
        h.update(len(key).to_bytes(8, "little"))  # where one key ends and the next begins
        for value in key:
            h.update(_encode(kind, value))
    return None if h is None else h.digest()


def _encode(kind: str, value: Any) -> bytes:
    """One field of an extra key, unambiguously (type tag, length, bytes)."""
    if isinstance(value, str):
        raw, tag = value.encode(), b"s"
    elif isinstance(value, bytes):
        raw, tag = value, b"b"
    elif isinstance(value, int) and not isinstance(value, bool):
        raw, tag = str(value).encode(), b"i"
    else:
        raise UnkeyedInput(f"{kind} key holding a {type(value).__name__}")
    return tag + len(raw).to_bytes(8, "little") + raw


def identity_ids(token_ids: Sequence[int], pages: Mapping[int, bytes], first: int, end: int,
                 page_size: int) -> np.ndarray:
    """The identity ids of pages ``first .. end-1`` (int64): the token ids, with every page
    in ``pages`` replaced by values derived from its tokens and its inputs' digest."""
    P = page_size
    ids = np.asarray(token_ids[first * P:end * P], dtype=np.int64)
    for page, digest in pages.items():
        if first <= page < end and len(ids) >= (page - first + 1) * P:
            run = ids[(page - first) * P:(page - first + 1) * P]
            h = hashlib.shake_256(_DOMAIN + digest + run.astype("<i8").tobytes())
            bits = np.frombuffer(h.digest(4 * P), dtype="<u4") & (DERIVED_BASE - 1)
            run[:] = bits.astype(np.int64) + DERIVED_BASE
    return ids


class InputReader:
    """:func:`read_inputs` for the connector: keeps the adapters' digests, and logs each
    kind it refuses once (a request refused is served by vLLM alone)."""

    def __init__(self) -> None:
        self.adapters = AdapterDigests()
        self._logged: set[str] = set()

    def read(self, request: Request, page_size: int) -> RequestInputs:
        inputs = read_inputs(request, page_size, self.adapters)
        if inputs.refused is not None and inputs.refused not in self._logged:
            self._logged.add(inputs.refused)
            _log.warning("hicache: requests with an input hicache cannot key (%s) are served "
                         "without it: nothing loaded or saved (logged once)", inputs.refused)
        return inputs


class AdapterDigests:
    """LoRA adapters' identities: ``name@sha256`` of every file under the adapter's
    directory (names and contents), hashed again when a file's size or modification
    time changes. Only local directories can be keyed (vLLM's worker may fetch other
    paths from a hub: those requests are refused)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, str]] = {}  # path -> (file stats, digest)

    def identity(self, lora: LoRARequest) -> str:
        """``name@sha256``; raises :class:`UnkeyedInput` when the files cannot be read."""
        path = os.path.expanduser(str(lora.lora_path))
        try:
            stats = _file_stats(path)
            known = self._known.get(path)
            if known is None or known[0] != stats:
                known = self._known[path] = (stats, _files_digest(path, stats))
        except OSError:
            raise UnkeyedInput("lora adapter without a readable local directory") from None
        return f"{lora.lora_name}@{known[1]}"


def _file_stats(path: str) -> tuple:
    """(relative name, size, mtime) of every regular file under ``path``, sorted."""
    if not os.path.isdir(path):
        raise OSError(f"not a directory: {path}")
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    if not out:
        raise OSError(f"no files in {path}")
    return tuple(out)


def _files_digest(path: str, stats: tuple) -> str:
    h = hashlib.sha256()
    for name, size, _ in stats:
        h.update(f"{name}\0{size}\n".encode())
        with open(os.path.join(path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
