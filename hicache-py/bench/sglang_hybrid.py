"""Hybrid models' sidecar pools: hicache's file tier against SGLang's own HiCacheFile, both through SGLang's v2 calls.

Each round backs up entries of one sidecar pool from SGLang's own host pool (``batch_set_v2``), asks which prefixes
are restorable (``batch_exists_v2``) and reads the entries back into other slots of the pool (``batch_get_v2``), for
each backend in turn on the same directory (who goes first alternates; each round's entries are removed before the
next). Pools: a Mamba state pool (``trailing_pages``: a state per node end, one entry per key here) and a DSA
indexer pool (``all_pages``), at the sizes below. The figure is GB/s of entry bytes for set and get, and
microseconds per query; each ratio is hicache over SGLang (a time ratio for the query: SGLang's over hicache's),
paired per round, median over rounds. Every entry read back is checked against the bytes written.

    target/python/venv/bin/python hicache-py/bench/sglang_hybrid.py [--dir DIR] [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import support  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from test_hybrid import dsa_pools, fill, mamba_pool, page  # noqa: E402

from hicache.sglang import HiCacheStorage  # noqa: E402


def pools():
    """(label, KV host pool, MLA or not, pool name, its host pool, its hit policy, entries per round)."""
    # 32 state slots of 8 layers of 16 x 64 x 64 fp32 temporal state and a 3 x 2048 bf16 conv state: 2.1 MB each
    states = mamba_pool(slots=66, layers=8, temporal=(16, 64, 64), conv=(3, 2048))
    yield "mamba", support.mha_pool("page_first"), False, PoolName.MAMBA, states, PoolHitPolicy.TRAILING_PAGES, 32
    # 128 pages of 64 tokens of the indexer of 8 layers: 68 KB each
    anchor, indexer = dsa_pools("page_first", layers=8, tokens=260 * 64)
    yield "indexer", anchor, True, PoolName.INDEXER, indexer, PoolHitPolicy.ALL_PAGES, 128


def timed(function, *args):
    started = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - started, result


def measure(label, kv_pool, mla, name, side_pool, policy, count, directory, rounds):
    ours = HiCacheStorage(support.storage_config({**support.MODULE, "dir": directory}, mla=mla), {})
    ours.register_mem_pool_host(kv_pool)
    ours.register_mem_host_pool_v2(side_pool, name)
    config = {"file_storage_path": directory, "enable_metadata_cache": False}
    theirs = HiCacheFile(support.storage_config(config, mla=mla))
    theirs.register_mem_pool_host(kv_pool)
    theirs.register_mem_host_pool_v2(side_pool, name)
    like = side_pool.get_dummy_flat_data_page()
    entry_bytes = like.numel() * like.element_size()
    gigabytes = count * entry_bytes / 1e9
    generator = torch.Generator().manual_seed(5)
    sources, targets = list(range(1, count + 1)), list(range(count + 1, 2 * count + 1))
    samples = {who: {"set": [], "query": [], "get": []} for who in ("hicache", "sglang")}
    for round_index in range(rounds):
        order = [("hicache", ours), ("sglang", theirs)]
        if round_index % 2:
            order.reverse()
        for who, backend in order:
            fill(side_pool, sources, generator)
            want = [page(side_pool, index) for index in sources]
            keys = support.random_keys(count, generator)
            transfer = PoolTransfer(
                name=name, keys=keys, host_indices=support.page_indices(sources, side_pool.page_size), hit_policy=policy
            )
            seconds, stored = timed(backend.batch_set_v2, [transfer])
            assert stored[name] == [True] * count, f"{who}: a write failed"
            samples[who]["set"].append(gigabytes / seconds)
            # the KV pages the query needs, untimed (SGLang's file backend stores them as it does any page)
            flat = [page(kv_pool, index) for index in range(1, count + 1)]
            if who == "hicache":
                assert all(backend.batch_set_v1(keys, support.page_indices(range(1, count + 1), kv_pool.page_size)))
            else:
                assert backend.batch_set(keys, flat)
            held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-1:]
            query = [PoolTransfer(name=name, keys=held, hit_policy=policy)]
            seconds, result = timed(backend.batch_exists_v2, keys, query)
            assert result.kv_hit_pages == count, f"{who}: {result.kv_hit_pages} of {count} restorable"
            samples[who]["query"].append(seconds * 1e6)
            back = PoolTransfer(
                name=name, keys=keys, host_indices=support.page_indices(targets, side_pool.page_size), hit_policy=policy
            )
            seconds, read = timed(backend.batch_get_v2, [back])
            assert read[name] == [True] * count, f"{who}: an entry did not read back"
            samples[who]["get"].append(gigabytes / seconds)
            for index, expected in zip(targets, want):
                assert support.same_bytes(page(side_pool, index), expected), f"{who}: entry {index} differs"
            ours.clear()
            theirs.clear()
    ours.close()
    result = {"pool": label, "entry_bytes": entry_bytes, "entries": count, "rounds": rounds}
    for what in ("set", "query", "get"):
        # higher is better for rates; for the query (microseconds) SGLang's over hicache's
        if what == "query":
            ratios = [b / a for a, b in zip(samples["hicache"][what], samples["sglang"][what])]
        else:
            ratios = [a / b for a, b in zip(samples["hicache"][what], samples["sglang"][what])]
        result[what] = {
            "hicache": statistics.median(samples["hicache"][what]),
            "sglang": statistics.median(samples["sglang"][what]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory both backends use (default: a new one under /tmp)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    figures = []
    with tempfile.TemporaryDirectory(prefix="hicache-bench-", dir=args.dir) as directory:
        for case in pools():
            figures.append(measure(*case, directory, args.rounds))
    print(f"{'pool':>8} {'entries':>14} {'op':>6} {'hicache':>12} {'SGLang':>12} {'ratio (median, min..max)':>26}")
    for row in figures:
        for what, unit in (("set", "GB/s"), ("query", "us"), ("get", "GB/s")):
            figure = row[what]
            print(
                f"{row['pool']:>8} {row['entries']:>4} x {row['entry_bytes']:>7} {what:>6} "
                f"{figure['hicache']:8.2f} {unit:>4} {figure['sglang']:8.2f} {unit:>4} "
                f"{figure['ratio_median']:10.2f} ({figure['ratio_min']:.2f}..{figure['ratio_max']:.2f})"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
