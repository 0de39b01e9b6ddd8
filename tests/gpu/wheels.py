"""The wheels a GPU machine without a package registry needs, downloaded into `.whl/`.

    python tests/gpu/wheels.py [--dest .whl] [--pack .gpu/wheels.tar.xz]
        [--image tests/gpu/image.txt]

The GPU image holds torch 2.11 (CUDA), Triton and Python 3.12 (`tests/gpu/image.txt`, its
`pip list --format=freeze` as the check's first step records it); what it lacks is fetched here
for that target: CPython 3.12 on manylinux x86-64, binary wheels only.

FlashInfer's wheel is 99 MB, its files 716 MB: the sources of every kernel it can JIT-compile.
What travels to the GPU machine is at most 64 MiB, so the wheel is cut to what attention needs
(`slim`): its Python code whole, the headers (include, cutlass, cccl, spdlog), and the
kernel sources at the top of data/csrc (the batch prefill ones among them); the kernel trees
of other features (MoE, communication, sampling, the cake_* training kernels) go, and so do the
requirements only they import (CuTe DSL, cuDNN, NCCL, cuda-tile), named in METADATA's place.

The set is proved to resolve offline for that target: `pip install --dry-run --no-index`
over the wheels, with the image's packages standing in as empty wheels of their versions. It
travels as one xz tarball (`--pack`, about 23 MiB): the slim wheel is stored uncompressed, so
that xz compresses across its files (deflate, file by file, left it at 36 MB).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLASHINFER = "flashinfer-python==0.7.4"  # the version models/flashinfer_backend.py is written for
CARRIED = [
    FLASHINFER,
    "apache-tvm-ffi==0.1.15.post2",  # FlashInfer's and xgrammar's compiled runtime
    "xgrammar==0.2.9",
    "pydantic==2.12.5",
    "pydantic-core==2.41.5",
    "annotated-types==0.7.0",
    "typing-inspection==0.4.2",
    "structlog==26.1.0",
    "gguf==0.19.0",
    "pytest-asyncio==1.5.0",
]
# what the image must hold for the carried set and the project (pyproject.toml)
FROM_IMAGE = [
    "torch",
    "triton",
    "numpy",
    "safetensors",
    "tokenizers",
    "jinja2",
    "aiohttp",
    "uvloop",
    "tqdm",
    "prometheus-client",
    "pytest",
    "pytest-timeout",
    "hypothesis",
]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (24, 27, 28, 31, 34)
]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
TARGET += [flag for p in PLATFORMS for flag in ("--platform", p)]
# requirements of FlashInfer features the cut removes; attention imports none of them
DROPPED_REQUIREMENTS = {
    "cuda-python",
    "cuda-tile",
    "nccl-extensions",
    "nccl4py",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
}
KEPT_DATA = ("include/", "cutlass/", "cccl/", "spdlog/")
SMALL = 64 * 1024  # other non-Python files kept where no kernel tree holds them


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def keep(name: str, size: int) -> bool:
    """Whether the slim FlashInfer wheel keeps this file."""
    if not name.startswith("flashinfer/"):
        return True  # the .dist-info
    if name.startswith("flashinfer/data/"):
        rest = name[len("flashinfer/data/") :]
        if rest.startswith("csrc/"):
            return "/" not in rest[len("csrc/") :]
        return rest.startswith(KEPT_DATA)
    if name.endswith((".py", ".pyi")):
        return True
    kernel_tree = re.search(r"/(csrc|kernel_src|generated|include)/", name)
    return kernel_tree is None and size <= SMALL


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel: Path) -> None:
    """Rewrite FlashInfer's wheel in place with the files `keep` chooses, its RECORD and
    METADATA to match."""
    out = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        record, records = None, []
        for info in src.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
                continue
            if not keep(info.filename, info.file_size):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/METADATA"):
                data = slim_metadata(data.decode()).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
            records.append(record_line(info.filename, data))
        assert record is not None, "a wheel without RECORD"
        dst.writestr(record, "\n".join([*records, f"{record},,"]) + "\n")
    out.replace(wheel)


def slim_metadata(text: str) -> str:
    lines = []
    for line in text.splitlines():
        req = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)", line)
        if req and req.group(1).lower() in DROPPED_REQUIREMENTS and "extra ==" not in line:
            continue
        lines.append(line)
    note = "Summary: FlashInfer, cut to its attention kernels for a registry-less GPU check"
    return "\n".join(note if line.startswith("Summary:") else line for line in lines) + "\n"


def stub_wheels(image: Path, dest: Path) -> None:
    """Empty wheels of the image's packages at their versions (metadata only)."""
    for line in image.read_text().splitlines():
        if "==" not in line:
            continue
        name, version = line.strip().split("==", 1)
        dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
        files = {
            f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
            f"Version: {version}\n",
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        }
        with zipfile.ZipFile(dest / f"{dist}-py3-none-any.whl", "w") as z:
            for path, text in files.items():
                z.writestr(path, text)
            record = [record_line(p, t.encode()) for p, t in files.items()]
            z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")


def prove(dest: Path, image: Path) -> None:
    """pip resolves the carried set and the project's imports offline for the target."""
    with tempfile.TemporaryDirectory() as stubs, tempfile.TemporaryDirectory() as target:
        stub_wheels(image, Path(stubs))
        names = [r.split("==")[0] for r in CARRIED] + FROM_IMAGE
        pip(
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(dest),
            "--find-links",
            stubs,
            *TARGET,
            "--target",
            target,
            *names,
        )


def pack(dest: Path, tarball: Path) -> None:
    tarball.parent.mkdir(exist_ok=True)
    names = sorted(p.name for p in dest.glob("*.whl"))
    with tarball.open("wb") as out:
        tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(dest), *names], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=out, check=True)
        if tar.wait():
            raise SystemExit("tar failed")
    print(f"{tarball}: {tarball.stat().st_size / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--pack", type=Path, default=ROOT / ".gpu/wheels.tar.xz")
    parser.add_argument("--image", type=Path, default=ROOT / "tests/gpu/image.txt")
    args = parser.parse_args()
    args.dest.mkdir(exist_ok=True)
    have = {p.name.split("-")[0].lower() for p in args.dest.glob("*.whl")}
    for req in CARRIED:
        if req.split("==")[0].replace("-", "_").lower() not in have:
            pip("download", "--quiet", "--no-deps", *TARGET, "--dest", str(args.dest), req)
            if req == FLASHINFER:
                slim(next(args.dest.glob("flashinfer_python-*.whl")))
    if args.image.exists():
        prove(args.dest, args.image)
    else:
        print(f"no {args.image}: the resolution is proved on the GPU machine only")
    if not args.pack.exists() or args.pack.stat().st_mtime < max(
        p.stat().st_mtime for p in args.dest.glob("*.whl")
    ):
        pack(args.dest, args.pack)


if __name__ == "__main__":
    main()
