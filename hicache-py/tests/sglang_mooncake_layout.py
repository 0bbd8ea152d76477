"""SGLang's own MooncakeStore describing its objects for routers, in a process of its own (Mooncake's official client,
which SGLang's store loads, and the store library the hicache package loads register the same flags and cannot share
one process).

Argument: JSON of `master` (host:port), `extra_backend_tag`, `official` (the directory of Mooncake's official Python
client). Prints JSON: `mla` (per pipeline stage of two, per TP rank of two, SGLang's
`describe_l3_object_layout`), `merged` (SGLang's `merge_l3_layouts` of them), `mha` (per TP rank of two: whether
SGLang served an MHA layout, and the keys its own key builder gives an empty page hash).
"""

import json
import sys

import support
import torch
from sglang.srt.mem_cache.hicache_storage import merge_l3_layouts
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore


def main():
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["official"])
    extra = support.official_mooncake_extra(spec)
    out = {"mla": [], "mha": []}
    for stage in range(2):
        for tp_rank in range(2):
            pool = support.mla_pool("page_first")
            store = MooncakeStore(support.storage_config(extra, mla=True, tp_rank=tp_rank, tp_size=2, pp=(stage, 2)))
            store.register_mem_pool_host(pool)
            out["mla"].append(
                store.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=None, page_size=pool.page_size)
            )
    out["merged"] = merge_l3_layouts(out["mla"])
    for tp_rank in range(2):
        pool = support.mha_pool("page_first")
        store = MooncakeStore(support.storage_config(extra, tp_rank=tp_rank, tp_size=2))
        store.register_mem_pool_host(pool)
        layout = store.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=None, page_size=pool.page_size)
        keys, _, _ = store._batch_preprocess([""], torch.arange(pool.page_size, dtype=torch.int64))
        out["mha"].append({"enabled": layout["enabled"], "keys": keys})
    print(json.dumps(out), flush=True)


main()
