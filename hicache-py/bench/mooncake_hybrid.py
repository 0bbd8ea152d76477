"""Hybrid models' sidecar pools on Mooncake under SGLang's own keys: hicache against SGLang's own MooncakeStore, both
through SGLang's v2 calls, on one `mooncake_master`.

Each side runs in a process of its own (Mooncake's official client, which SGLang's store loads, and the store library
hicache loads cannot share one), one after the other, each mounting its own segment. A round backs up entries of one
sidecar pool from SGLang's own host pool (``batch_set_v2``), asks which prefixes are restorable (``batch_exists_v2``,
the KV pages stored beforehand, untimed) and reads the entries back into other slots of the pool (``batch_get_v2``),
every entry checked against the bytes written; then the entries are removed. Pools as in ``sglang_hybrid.py``: a Mamba
state pool (``trailing_pages``) and a DSA indexer pool (``all_pages``). Both sides write the same objects: hicache
under ``key_scheme: sglang`` names them as SGLang's store does. The figure is GB/s of entry bytes for set and get, and
microseconds per query, the median of the rounds; runs alternate between the sides (``--runs`` each); the ratio is
hicache's median over SGLang's (SGLang's over hicache's for the query), per pair of runs.

    cargo xtask mooncake   # unpacks mooncake_master, the store library and the official client under target/mooncake
    target/python/venv/bin/python hicache-py/bench/mooncake_hybrid.py [--rounds 7] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def side(spec):
    """One side's rounds for one pool, in this process: the samples, as JSON on the last line."""
    import torch

    import support
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
    from sglang_hybrid import pools  # the bench's pools, beside this file
    from test_hybrid import fill, page

    label, kv_pool, mla, name, side_pool, policy, count = next(case for case in pools() if case[0] == spec["pool"])
    extra = {**support.official_mooncake_extra(spec), "global_segment_size": 1 << 30, "local_buffer_size": 64 << 20}
    config = support.storage_config(extra if spec["side"] == "sglang" else {**extra, **spec["hicache"]}, mla=mla)
    if spec["side"] == "sglang":
        sys.path.insert(0, spec["official"])
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        backend = MooncakeStore(config)
    else:
        from hicache.sglang import HiCacheStorage

        backend = HiCacheStorage(config, {})
    backend.register_mem_pool_host(kv_pool)
    backend.register_mem_host_pool_v2(side_pool, name)
    like = side_pool.get_dummy_flat_data_page()
    entry_bytes = like.numel() * like.element_size()
    gigabytes = count * entry_bytes / 1e9
    generator = torch.Generator().manual_seed(spec["seed"])
    sources, targets = list(range(1, count + 1)), list(range(count + 1, 2 * count + 1))
    samples = {"set": [], "query": [], "get": []}
    for _ in range(spec["rounds"]):
        fill(side_pool, sources, generator)
        want = [page(side_pool, index) for index in sources]
        keys = support.random_keys(count, generator)
        indices = support.page_indices(sources, side_pool.page_size)
        transfer = PoolTransfer(name=name, keys=keys, host_indices=indices, hit_policy=policy)
        started = time.perf_counter()
        stored = backend.batch_set_v2([transfer])
        samples["set"].append(gigabytes / (time.perf_counter() - started))
        assert stored[name] == [True] * count, f"{spec['side']}: a write failed"
        assert all(backend.batch_set_v1(keys, support.page_indices(sources, kv_pool.page_size)))
        held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-1:]
        query = [PoolTransfer(name=name, keys=held, hit_policy=policy)]
        started = time.perf_counter()
        result = backend.batch_exists_v2(keys, query)
        samples["query"].append((time.perf_counter() - started) * 1e6)
        assert result.kv_hit_pages == count, f"{spec['side']}: {result.kv_hit_pages} of {count} restorable"
        back = PoolTransfer(
            name=name, keys=keys, host_indices=support.page_indices(targets, side_pool.page_size), hit_policy=policy
        )
        started = time.perf_counter()
        read = backend.batch_get_v2([back])
        samples["get"].append(gigabytes / (time.perf_counter() - started))
        assert read[name] == [True] * count, f"{spec['side']}: an entry did not read back"
        for index, expected in zip(targets, want):
            assert support.same_bytes(page(side_pool, index), expected), f"{spec['side']}: entry {index} differs"
        backend.clear()
    backend.close()
    print(json.dumps({"entry_bytes": entry_bytes, "entries": count, "samples": samples}))


def run_side(spec, env):
    done = subprocess.run(
        [sys.executable, __file__, "--side", json.dumps(spec)], capture_output=True, text=True, timeout=600, env=env
    )
    if done.returncode:
        sys.exit(f"the {spec['side']} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return side(json.loads(args.side))
    import support
    import test_mooncake

    test_mooncake.setUpModule()
    master = test_mooncake.Master()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.join(HERE, "..", "tests")])}
    if test_mooncake.NEEDS_SHIM:
        shim = os.path.dirname(test_mooncake.SHIM)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([shim, os.environ.get("LD_LIBRARY_PATH", "")])
    env["MOONCAKE_STORE_LIBRARY"] = test_mooncake.LIBRARY
    figures = []
    try:
        for pool in ("mamba", "indexer"):
            runs = {"hicache": [], "sglang": []}
            for run in range(args.runs):
                order = ["hicache", "sglang"] if run % 2 == 0 else ["sglang", "hicache"]
                for who in order:
                    spec = {
                        "side": who,
                        "pool": pool,
                        "rounds": args.rounds,
                        "seed": 5 + run,
                        "master": f"127.0.0.1:{master.port}",
                        "official": test_mooncake.OFFICIAL,
                        "extra_backend_tag": "bench",
                        "hicache": {"backend": "mooncake", "key_scheme": "sglang", "library": test_mooncake.LIBRARY,
                                    **support.MODULE},
                    }
                    runs[who].append(run_side(spec, env))
            first = runs["hicache"][0]
            row = {"pool": pool, "entry_bytes": first["entry_bytes"], "entries": first["entries"], "rounds": args.rounds}
            for what in ("set", "query", "get"):
                medians = {who: [statistics.median(r["samples"][what]) for r in runs[who]] for who in runs}
                pairs = zip(medians["hicache"], medians["sglang"])
                ratios = [b / a if what == "query" else a / b for a, b in pairs]
                row[what] = {"hicache": medians["hicache"], "sglang": medians["sglang"], "ratios": ratios}
            figures.append(row)
    finally:
        master.stop()
    print(f"{'pool':>8} {'entries':>14} {'op':>6} {'hicache (per run)':>28} {'SGLang (per run)':>28} {'ratios':>18}")
    for row in figures:
        for what, unit in (("set", "GB/s"), ("query", "us"), ("get", "GB/s")):
            figure = row[what]
            cell = lambda values: " ".join(f"{value:.2f}" for value in values)  # noqa: E731
            print(
                f"{row['pool']:>8} {row['entries']:>4} x {row['entry_bytes']:>7} {what:>6} "
                f"{cell(figure['hicache']):>23} {unit:>4} {cell(figure['sglang']):>23} {unit:>4} "
                f"{cell(figure['ratios']):>18}"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
