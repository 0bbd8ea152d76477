"""hicache's file tier against SGLang's own HiCacheFile, both driven through SGLang's HiCache controller code.

Each round writes 128 fresh pages from an SGLang host pool (page_first, bf16) and reads them back into it, through
the functions SGLang's `HiCacheController` runs for each backend: `_page_set_zero_copy` / `_page_get_zero_copy`
(what `interface_v1` selects) for hicache, `_generic_page_set` / `_generic_page_get` for HiCacheFile (SGLang's file
backend has no zero-copy path). Both use the same directory; each round's pages are removed before the next. The
figure is GB/s of page bytes; the ratio is hicache over SGLang, paired per round, median over rounds.

It also measures what a 128-page `batch_get_v1` costs in Python and the binding on the in-memory tier, with pages
so small (32 bytes) that the call is all overhead.

    target/python/venv/bin/python hicache-py/bench/sglang_file.py [--dir DIR] [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
import warnings

warnings.filterwarnings("ignore", message="Only CUDA")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import support  # noqa: E402

from hicache.sglang import HiCacheStorage  # noqa: E402

PAGES = 128
# (name, layers, kv heads, head dim): bf16, 64 tokens per page
SHAPES = {"8MiB": (32, 8, 128), "128KiB": (4, 2, 64)}
PAGE_SIZE = 64


class Operation:
    """What SGLang's controller passes its page-get functions (only logged on a miss)."""

    request_id = "bench"

    def is_terminated(self):
        return False


def controller(pool, backend):
    """The parts of an `HiCacheController` its page functions read."""
    return types.SimpleNamespace(storage_host_pool=pool, mem_pool_host=pool, storage_backend=backend, page_size=PAGE_SIZE)


def timed(function, *args):
    started = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - started, result


def measure(shape, directory, rounds):
    layers, heads, head_dim = SHAPES[shape]
    pool = support.mha_pool(
        "page_first", layers=layers, heads=heads, head_dim=head_dim, page_size=PAGE_SIZE, device_tokens=PAGES * PAGE_SIZE
    )
    support.randomize(pool, 1)
    page_bytes = pool.get_size_per_token() * PAGE_SIZE
    indices = support.page_indices(range(PAGES), PAGE_SIZE)
    ours = HiCacheStorage(support.storage_config({**support.MODULE, "dir": directory}), {})
    ours.register_mem_pool_host(pool)
    theirs = HiCacheFile(support.storage_config({"file_storage_path": directory}))
    ours_controller, their_controller = controller(pool, ours), controller(pool, theirs)
    generator = torch.Generator().manual_seed(2)
    samples = {"hicache": {"set": [], "get": []}, "sglang": {"set": [], "get": []}}
    gigabytes = PAGES * page_bytes / 1e9
    for round_index in range(rounds):
        # alternate who goes first, so neither always meets a cooler page cache
        order = [("hicache", ours_controller), ("sglang", their_controller)]
        if round_index % 2:
            order.reverse()
        for name, fake in order:
            keys = support.random_keys(PAGES, generator)
            if name == "hicache":
                seconds, ok = timed(HiCacheController._page_set_zero_copy, fake, keys, indices)
            else:
                seconds, ok = timed(HiCacheController._generic_page_set, fake, keys, indices)
            assert ok, f"{name}: a write failed"
            samples[name]["set"].append(gigabytes / seconds)
            if name == "hicache":
                seconds, hits = timed(HiCacheController._page_get_zero_copy, fake, Operation(), keys, indices)
            else:
                seconds, hits = timed(HiCacheController._generic_page_get, fake, Operation(), keys, indices)
            assert hits == PAGES, f"{name}: {hits} of {PAGES} pages read"
            samples[name]["get"].append(gigabytes / seconds)
            fake.storage_backend.clear()
    ours.close()
    result = {"page_bytes": page_bytes, "pages": PAGES, "rounds": rounds}
    for direction in ("set", "get"):
        ratios = [a / b for a, b in zip(samples["hicache"][direction], samples["sglang"][direction])]
        result[direction] = {
            "hicache_gbps": statistics.median(samples["hicache"][direction]),
            "sglang_gbps": statistics.median(samples["sglang"][direction]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return result


def overhead(calls):
    """Microseconds per 128-page `batch_get_v1` on the memory tier with 32-byte pages."""
    pool = support.mha_pool("page_first", layers=1, heads=1, head_dim=8, page_size=1, device_tokens=2 * PAGES)
    backend = HiCacheStorage(support.storage_config({**support.MODULE, "backend": "memory"}), {})
    backend.register_mem_pool_host(pool)
    keys = support.random_keys(PAGES, torch.Generator().manual_seed(3))
    indices = support.page_indices(range(PAGES), 1)
    assert all(backend.batch_set_v1(keys, indices))
    for _ in range(100):
        backend.batch_get_v1(keys, indices)
    started = time.perf_counter()
    for _ in range(calls):
        backend.batch_get_v1(keys, indices)
    per_call = (time.perf_counter() - started) / calls * 1e6
    backend.close()
    return {"pages": PAGES, "page_bytes": 32, "calls": calls, "microseconds_per_call": per_call}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory both backends use (default: a new one under /tmp)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5000, help="batch_get_v1 calls for the overhead figure")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-", dir=args.dir) as directory:
        figures = {shape: measure(shape, directory, args.rounds) for shape in SHAPES}
    figures["overhead"] = overhead(args.calls)
    print(f"{'pages':>14} {'op':>4} {'hicache GB/s':>13} {'SGLang GB/s':>12} {'ratio (median, min..max)':>26}")
    for shape in SHAPES:
        for direction in ("set", "get"):
            row = figures[shape][direction]
            print(
                f"{PAGES} x {shape:>7} {direction:>4} {row['hicache_gbps']:13.2f} {row['sglang_gbps']:12.2f} "
                f"{row['ratio_median']:10.2f} ({row['ratio_min']:.2f}..{row['ratio_max']:.2f})"
            )
    print(f"batch_get_v1 overhead: {figures['overhead']['microseconds_per_call']:.1f} us per 128-page call (memory tier)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
