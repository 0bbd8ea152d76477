#!/usr/bin/env python3
"""Golden answers of SGLang 0.5.23's `HiCacheFile.batch_exists_v2` for hybrid models' page groups, made by SGLang's
own code.

Command that made sglang_0_5_23_pool_groups.json (run from the repository root with a Python that has sglang==0.5.23
and torch, such as the one the test command sets up under target/python/venv):

    target/python/venv/bin/python hicache-core/tests/data/make_pool_groups_0_5_23.py \
        > hicache-core/tests/data/sglang_0_5_23_pool_groups.json

For random runs of pages, each case creates in a fresh directory the files SGLang's `HiCacheFile` would hold (a page's
KV entry as `{key}_{model}_{rank}_{size}.bin`, a sidecar pool's entry as `{key}.{pool}_{model}_{rank}_{size}.bin`,
named by `HiCacheFile`'s own `_get_component_key`), for a random subset of the pages per pool, then asks
`batch_exists_v2` with one `PoolTransfer` per sidecar pool (its hit policy, and for `trailing_pages` a window of as
many keys as the transfer carries) and records the `PoolTransferResult`.

It also records the file names `HiCacheFile` gives a page's KV entry and its sidecar pools' entries, for MHA and MLA
models, tensor-parallel ranks and pipeline stages (`names`).
"""
import json
import os
import random
import sys
import tempfile

import sglang
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

SEED = 20261205
CASES = 400
SIDECARS = [PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER, PoolName.DRAFT]


def storage(folder, mla=False, tp=(0, 1), pp=(0, 1)):
    config = HiCacheStorageConfig(
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="golden/model",
        extra_config={"file_storage_path": folder, "enable_metadata_cache": False},
    )
    return HiCacheFile(config, file_path=folder)


def touch(backend, key, pool=None):
    name = backend._get_component_key(key, pool)
    with open(os.path.join(backend.file_path, f"{name}.bin"), "wb") as file:
        file.write(b"\0")


def main():
    assert sglang.__version__ == "0.5.23", sglang.__version__
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    rng = random.Random(SEED)
    cases = []
    with tempfile.TemporaryDirectory() as root:
        for case in range(CASES):
            backend = storage(os.path.join(root, str(case)))
            pages = rng.randrange(0, 12)
            keys = [f"{rng.getrandbits(128):032x}" for _ in range(pages)]
            kv = [rng.random() < 0.85 for _ in range(pages)]
            pools = []
            for name in rng.sample(SIDECARS, rng.randrange(0, 4)):
                policy = rng.choice([PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
                window = rng.randrange(0, 4) if policy == PoolHitPolicy.TRAILING_PAGES else 0
                held = [rng.random() < 0.7 for _ in range(pages)]
                pools.append((name, policy, window, held))
            for page, key in enumerate(keys):
                if kv[page]:
                    touch(backend, key)
                for name, _, _, held in pools:
                    if held[page]:
                        touch(backend, key, name)
            transfers = [
                PoolTransfer(
                    name=name,
                    keys=[f"window-{index}" for index in range(window)] or None,
                    hit_policy=policy,
                )
                for name, policy, window, _ in pools
            ]
            result = backend.batch_exists_v2(keys, transfers)
            cases.append(
                {
                    "kv": kv,
                    "pools": [
                        {"name": str(name), "policy": policy.value, "window": window, "held": held}
                        for name, policy, window, held in pools
                    ],
                    "kv_hit_pages": result.kv_hit_pages,
                    "pool_hit_pages": {str(name): pages for name, pages in result.extra_pool_hit_pages.items()},
                    "restorable": result.restorable_prefix_pages,
                }
            )
        names = []
        for mla, tp, pp in [(False, (0, 1), (0, 1)), (False, (1, 2), (0, 1)), (True, (1, 2), (0, 1)), (False, (0, 2), (1, 2)), (True, (3, 4), (1, 2))]:
            backend = storage(os.path.join(root, "names"), mla=mla, tp=tp, pp=pp)
            key = f"{rng.getrandbits(256):064x}"
            names.append(
                {
                    "mla": mla,
                    "tp": list(tp),
                    "pp": list(pp),
                    "key": key,
                    "files": {
                        str(pool): f"{backend._get_component_key(key, pool)}.bin"
                        for pool in [PoolName.KV, *SIDECARS]
                    },
                }
            )
    json.dump(
        {"sglang": sglang.__version__, "seed": SEED, "cases": cases, "names": names}, sys.stdout, separators=(",", ":")
    )
    print()


if __name__ == "__main__":
    main()
