"""This machine's memory bandwidth, measured one way: a read-only streaming pass.

    python -m bench.bandwidth [--threads 2] [--repeats 15] [--mib N]

A float32 buffer of max(128 MiB, 4x the last-level cache) is summed: every byte is read once,
from memory rather than from a cache, and nothing is written back. The median over the repeats
(after one untimed pass) gives bytes/s. A batch-1 decode step streams every weight once, so a
forward's floor is its weight bytes over this bandwidth (`floor_seconds`); bench/peer.py prints
it beside each server's speed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

MIN_BUFFER = 128 << 20  # bytes; also the buffer when the last-level cache is unknown
CACHE_MULTIPLE = 4  # the buffer outsizes the last-level cache this many times
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size_bytes(text: str) -> int:
    """'266240K', '32M' or '1024' (sysfs) as bytes."""
    text = text.strip()
    unit = UNITS.get(text[-1:].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def _sysfs_llc() -> int | None:
    """The data or unified cache of the highest level that cpu0 sees, from sysfs."""
    best: tuple[int, int] | None = None
    for index in CPU_CACHES.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        best = max(best or (level, size), (level, size))
    return best[1] if best else None


def _lscpu_llc() -> int | None:
    """The largest cache lscpu lists (sizes in bytes, all instances of a level together)."""
    try:
        out = subprocess.run(
            ["lscpu", "--caches=NAME,ALL-SIZE", "--bytes"], capture_output=True, text=True
        ).stdout
    except OSError:
        return None
    sizes = [
        int(f[-1]) for f in (line.split() for line in out.splitlines()[1:]) if f and f[-1].isdigit()
    ]
    return max(sizes, default=None)


def last_level_cache_bytes() -> int | None:
    """The last-level cache's size in bytes (sysfs, else lscpu); None when neither tells."""
    return _sysfs_llc() or _lscpu_llc()


def buffer_bytes(llc: int | None) -> int:
    """max(128 MiB, 4x the last-level cache), a whole number of 4 KiB pages."""
    size = max(MIN_BUFFER, CACHE_MULTIPLE * (llc or 0))
    return -(-size // 4096) * 4096


def measure_bandwidth(threads: int = 2, repeats: int = 15, nbytes: int | None = None) -> float:
    """Read bandwidth in bytes/s: the median time of summing a float32 buffer of `nbytes`
    (default: `buffer_bytes` of this machine's last-level cache) with `threads` threads."""
    nbytes = nbytes or buffer_bytes(last_level_cache_bytes())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # touched: no page faults timed
        buffer.sum()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return nbytes / statistics.median(times)


def floor_seconds(weight_bytes: float, bandwidth: float) -> float:
    """The least time a forward can take that streams `weight_bytes` at `bandwidth` bytes/s."""
    return weight_bytes / bandwidth


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.bandwidth", description=__doc__.split("\n")[0]
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads (the cores here)")
    p.add_argument("--repeats", type=int, default=15, help="timed passes (median)")
    p.add_argument("--mib", type=int, help="buffer size (default: max(128, 4x the LLC) MiB)")
    args = p.parse_args(argv)
    llc = last_level_cache_bytes()
    nbytes = (args.mib << 20) if args.mib else buffer_bytes(llc)
    bandwidth = measure_bandwidth(args.threads, args.repeats, nbytes)
    cache = f"{llc / (1 << 20):.0f} MiB" if llc else "unknown"
    print(f"last-level cache {cache}; buffer {nbytes / (1 << 20):.0f} MiB; {args.threads} threads")
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (median of {args.repeats} passes)")


if __name__ == "__main__":
    main()
