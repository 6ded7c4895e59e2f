"""What a request's KV depends on besides its token ids, and how hicache keys it.

vLLM's block hash chains a block's token ids with *extra keys*
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``): the LoRA
adapter, the multimodal items overlapping the block (``("mm", identifier, offset)``,
the identifier being the item's content hash), the digest of the block's prompt
embeddings (``("prompt_embeds", sha256)``) and ``cache_salt`` on the first block.
hicache keys its pages by token ids (the radix tree, the third tier's chained keys),
so it carries the same distinctions:

* **LoRA**: the adapter is part of the request's namespace, as its name and a digest
  of its files taken when it is first used (:class:`AdapterDigests`): two adapters
  registered under one name (on two instances) never share, one whose files change
  after its first use is refused, and the base model is a namespace of its own.
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
  guess. So does a streaming-input session (vLLM 0.32's ``resumable`` requests): its
  later chunks bring tokens and multimodal items this reading, done when the session
  arrives, never saw.

Identity ids lie in ``[2**30, 2**31)``, above every vocabulary, so a derived page never
equals a text page; each of its positions carries 30 bits of a SHA-256 digest of the
page's tokens and inputs. vLLM is imported only by :func:`read_inputs`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
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
        if getattr(request, "resumable", False):
            # vLLM 0.32's streaming input: later chunks add tokens and items (and drop
            # the last sampled token) after this reading; never keyed by the first alone
            raise UnkeyedInput("streaming input session")
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
    except Exception as exc:  # never in vLLM's scheduler loop: not keyed, served by vLLM
        return RequestInputs(refused=f"{type(exc).__name__} reading the request's inputs")
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
    """LoRA adapters' identities: ``name@sha256`` of the files under the adapter's
    directory (names and contents), taken once per ``(lora_name, lora_int_id,
    lora_path)``, the first time a request names it.

    vLLM's worker loads an adapter id's files once and computes with those weights until
    it drops the adapter (``LRUCacheWorkerLoRAManager.add_adapter`` reloads a loaded id
    only with ``load_inplace``): the digest taken at first sight is what its KV depends
    on. Files changed after that (their names, sizes, modification or change times,
    inodes; looked at again at most every ``recheck_s`` seconds, never hashed again)
    refuse the adapter from then on: the weights the worker computes with are no longer
    known (it may have loaded the old files or, after dropping them, the new ones). A
    request with ``load_inplace`` (vLLM reloads the files whenever it sees it) is refused
    too. So is a directory that is not local and readable (vLLM's worker may fetch other
    paths from a hub), holds anything but regular files (a FIFO would block the read),
    more than ``MAX_ADAPTER_FILES`` files or more than ``MAX_ADAPTER_BYTES`` bytes."""

    def __init__(self, recheck_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recheck_s = ADAPTER_RECHECK_S if recheck_s is None else recheck_s
        self._clock = clock
        # (name, id, path) -> the adapter as first seen
        self._known: OrderedDict[tuple[str, int, str], _Adapter] = OrderedDict()
        self._changed: set[tuple[str, int, str]] = set()  # never forgotten, never keyed

    def identity(self, lora: LoRARequest) -> str:
        """``name@sha256``; raises :class:`UnkeyedInput` when the adapter is refused."""
        if getattr(lora, "load_inplace", False):
            raise UnkeyedInput("lora adapter loaded in place (load_inplace)")
        path = os.path.expanduser(str(lora.lora_path))
        key = (str(lora.lora_name), int(lora.lora_int_id), path)
        if key in self._changed:
            raise UnkeyedInput(_CHANGED)
        now = self._clock()
        known = self._known.get(key)
        if known is None or (known.digest is None and now - known.checked >= self.recheck_s):
            known = self._known[key] = _first_sight(path, now)
            if known.refused == _CHANGED:  # while hashed: vLLM may have loaded either
                self._changed.add(key)
            while len(self._known) > MAX_KNOWN_ADAPTERS:
                self._known.popitem(last=False)
        elif known.digest is not None and now - known.checked >= self.recheck_s:
            known.checked = now
            try:
                stats = _file_stats(path)
            except (OSError, UnkeyedInput):
                stats = None
            if stats != known.stats:
                self._changed.add(key)
                del self._known[key]
                raise UnkeyedInput(_CHANGED)
        self._known.move_to_end(key)
        if known.digest is None:
            raise UnkeyedInput(known.refused)
        return f"{lora.lora_name}@{known.digest}"


# An adapter's directory is hashed once (AdapterDigests); more is refused.
MAX_ADAPTER_BYTES = 1 << 30
MAX_ADAPTER_FILES = 1024
ADAPTER_RECHECK_S = 1.0  # a known adapter's file stats are looked at again this often
MAX_KNOWN_ADAPTERS = 4096  # adapters remembered (the oldest seen are hashed again)
_CHANGED = "lora adapter whose files changed after it was first used"


class _Adapter:
    """An adapter as first seen: its files' stats and digest (None: refused, why)."""

    __slots__ = ("digest", "stats", "checked", "refused")

    def __init__(self, digest: str | None, stats: tuple, checked: float,
                 refused: str = "") -> None:
        self.digest, self.stats, self.checked = digest, stats, checked
        self.refused = refused


def _first_sight(path: str, now: float) -> _Adapter:
    try:
        stats = _file_stats(path)
        return _Adapter(_files_digest(path, stats), stats, now)
    except OSError:
        return _Adapter(None, (), now, "lora adapter without a readable local directory")
    except UnkeyedInput as exc:
        return _Adapter(None, (), now, exc.kind)


def _file_stats(path: str) -> tuple:
    """(relative name, size, mtime, ctime, device, inode) of every file under ``path``,
    sorted; raises :class:`UnkeyedInput` for what cannot be hashed (not a regular file,
    too many files or bytes), ``OSError`` when it cannot be read."""
    if not os.path.isdir(path):
        raise OSError(f"not a directory: {path}")

    def fail(exc: OSError) -> None:
        raise exc

    out: list[tuple[str, int, int, int, int, int]] = []
    total = 0
    for root, dirs, files in os.walk(path, onerror=fail):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)  # a symlink's target (the hub cache links its files)
            if not stat.S_ISREG(st.st_mode):
                raise UnkeyedInput("lora adapter holding a file that is not a regular file")
            total += st.st_size
            if len(out) >= MAX_ADAPTER_FILES or total > MAX_ADAPTER_BYTES:
                raise UnkeyedInput(f"lora adapter over {MAX_ADAPTER_FILES} files or "
                                   f"{MAX_ADAPTER_BYTES} bytes")
            out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns,
                        st.st_ctime_ns, st.st_dev, st.st_ino))
    if not out:
        raise OSError(f"no files in {path}")
    return tuple(out)


def _files_digest(path: str, stats: tuple) -> str:
    """SHA-256 of the names and contents of the files of ``stats`` (each read as a
    regular file of its size, never waiting on one that is not)."""
    h = hashlib.sha256()
    for name, size, *_ in stats:
        h.update(f"{name}\0{size}\n".encode())
        fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise UnkeyedInput(_CHANGED)
            left = size
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    raise UnkeyedInput(_CHANGED)
                h.update(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
    return h.hexdigest()
