"""SGLang's own MooncakeStore writing or reading a hybrid model's page groups (the KV pages and a sidecar pool's
entries), in a process of its own with Mooncake's official Python client (it and the store library the hicache
package loads register the same flags and cannot share one process).

Argument: JSON of `master` (host:port), `official` (the directory of Mooncake's official Python client),
`extra_backend_tag`, `global_segment_size` (optional; 0 mounts no memory, so what it writes lands in another
client's segment and outlives this process), `case` (a label of `test_hybrid.cases()`), `tp_rank`, `tp_size`,
`seed` (the bytes: the pools are filled as `fill` fills them from a generator of this seed), `keys` (the run's page
hashes) and `mode`:

* `write`: fills the pools, then backs the run up as SGLang's hybrid controller does: the sidecar entries with
  `batch_set_v2` (every page, or the trailing window), then the KV pages with `batch_set_v1`. Prints the results,
  the key suffixes of the sidecar pool's objects and the store's `describe_l3_object_layout`.
* `read`: asks `batch_exists_v2`, then reads the sidecar entries (`batch_get_v2`) and the KV pages (`batch_get_v1`)
  over other bytes. Prints the answers and the SHA-256 of every page read.
"""

import hashlib
import json
import sys

import support
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from test_hybrid import cases, fill, page, transfer


def digest(tensor):
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main():
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["official"])
    extra = support.official_mooncake_extra(spec)
    label, kv_pool, mla, name, side_pool, policy, window = next(case for case in cases() if case[0] == spec["case"])
    keys = spec["keys"]
    pages = list(range(1, len(keys) + 1))
    held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-window:]
    side_pages = pages if policy == PoolHitPolicy.ALL_PAGES else pages[-window:]
    config = support.storage_config(extra, mla=mla, tp_rank=spec["tp_rank"], tp_size=spec["tp_size"])
    store = MooncakeStore(config)
    store.register_mem_pool_host(kv_pool)
    store.register_mem_host_pool_v2(side_pool, name)
    if spec["mode"] == "write":
        generator = torch.Generator().manual_seed(spec["seed"])
        fill(kv_pool, pages, generator)
        fill(side_pool, pages, generator)
        side = store.batch_set_v2([transfer(name, side_pool, held, side_pages, policy)])[name]
        kv = store.batch_set_v1(keys, support.page_indices(pages, kv_pool.page_size))
        suffixes, _ = store._get_hybrid_page_component_keys([""], PoolTransfer(name=name))
        layout = store.describe_l3_object_layout(
            sidecar_pool_specs=(), swa_trailing_pages=window or None, page_size=kv_pool.page_size
        )
        out = {"side": side, "kv": kv, "suffixes": suffixes, "layout": layout}
    else:
        # other bytes where the pages go, so that only what is read makes them match
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        fill(kv_pool, pages, generator)
        fill(side_pool, pages, generator)
        result = store.batch_exists_v2(keys, [PoolTransfer(name=name, keys=held, hit_policy=policy)])
        side = store.batch_get_v2([transfer(name, side_pool, held, side_pages, policy)])[name]
        kv = store.batch_get_v1(keys, support.page_indices(pages, kv_pool.page_size))
        out = {
            "restorable": list(result.restorable_prefix_pages),
            "side": side,
            "kv": kv,
            "kv_pages": [digest(page(kv_pool, index)) for index in pages],
            "side_pages": [digest(page(side_pool, index)) for index in side_pages],
        }
    store.close()
    print(json.dumps(out), flush=True)


main()
