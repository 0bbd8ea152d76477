"""The reference `hicache bench storage --backend mooncake` measures against: Mooncake's official Python client
(`mooncake.store.MooncakeDistributedStore`, as SGLang uses it) putting and getting the same objects: each page as two
objects of half its size (K and V, as SGLang and hicache store them), from and into registered host memory, in batches
of the same number of pages, against the same master, with a client set up as hicache's is.

Argument: a JSON object (master, local_hostname, metadata_server, protocol, device, segment, buffer, pages,
page_bytes, batch, prefer_local: whether hicache's puts ask for their own segment first). Prints `ready`, then for each line `round N` on stdin measures one round (fresh keys: put every
page, get every page, check the bytes, remove them, first with the client's default placement, as SGLang puts, then
with hicache's placement (the client's own segment first when prefer_local); then SGLang's batch_set with fresh keys:
the existence query and a put of what is missing) and prints one JSON line {set_gbps, get_gbps, local_set_gbps,
local_get_gbps, exists_then_put_gbps}; it keeps its
client, and the segment it lends, until stdin closes, so hicache's rounds, interleaved with these, run against the
same cluster.
"""

import ctypes
import json
import os
import sys
import time

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as error:
    sys.exit(
        f"the reference needs Mooncake's official Python client ({error}): pip install "
        "mooncake-transfer-engine-non-cuda, or put the folder holding its `mooncake` package on PYTHONPATH"
    )


def main():
    spec = json.loads(sys.argv[1])
    store = MooncakeDistributedStore()
    status = store.setup(
        spec["local_hostname"],
        spec["metadata_server"],
        spec["segment"],
        spec["buffer"],
        spec["protocol"],
        spec["device"],
        spec["master"],
    )
    if status != 0:
        sys.exit(f"the official client's setup failed: {status}")
    pages, page_bytes, batch = spec["pages"], spec["page_bytes"], spec["batch"]
    half = page_bytes // 2
    total = pages * page_bytes
    source = ctypes.create_string_buffer(os.urandom(total), total)
    target = ctypes.create_string_buffer(total)
    for buffer in (source, target):
        if store.register_buffer(ctypes.addressof(buffer), total) != 0:
            sys.exit("register_buffer failed")
    # the same client's puts with hicache's placement: the first replica asked of its own segment when hicache asks
    local = ReplicateConfig()
    if spec["prefer_local"]:
        local.preferred_segment = store.get_hostname()
    print("ready", flush=True)
    for line in sys.stdin:
        round_index = int(line.split()[1])
        prefix = f"hicache-bench-reference-{os.getpid()}-{round_index}"
        batches = []
        for first in range(0, pages, batch):
            count = min(batch, pages - first)
            keys, offsets = [], []
            for page in range(first, first + count):
                keys += [f"{prefix}-{page}-k", f"{prefix}-{page}-v"]
                offsets += [page * page_bytes, page * page_bytes + half]
            batches.append((keys, offsets, [half] * len(keys)))

        def put_then_get(config):
            """Puts every page (with `config`, or the client's default placement), gets every page back, checks
            the bytes and removes the objects; the two rates in GB/s."""
            base = ctypes.addressof(source)
            started = time.perf_counter()
            for keys, offsets, sizes in batches:
                addresses = [base + offset for offset in offsets]
                if config is None:
                    results = store.batch_put_from(keys, addresses, sizes)
                else:
                    results = store.batch_put_from(keys, addresses, sizes, config)
                if any(result != 0 for result in results):
                    sys.exit(f"batch_put_from: {results[:8]}")
            put = total / (time.perf_counter() - started) / 1e9
            base = ctypes.addressof(target)
            started = time.perf_counter()
            for keys, offsets, sizes in batches:
                results = store.batch_get_into(keys, [base + offset for offset in offsets], sizes)
                if any(result != half for result in results):
                    sys.exit(f"batch_get_into: {results[:8]}")
            get = total / (time.perf_counter() - started) / 1e9
            if target.raw != source.raw:
                sys.exit("the official client read back bytes that differ from those written")
            ctypes.memset(target, 0, total)
            store.remove_by_regex(f"^{prefix}-", True)
            return put, get

        set_gbps, get_gbps = put_then_get(None)
        local_set_gbps, local_get_gbps = put_then_get(local)
        # SGLang's batch_set: the existence query, then a put of the missing objects (all of them, fresh keys)
        base = ctypes.addressof(source)
        started = time.perf_counter()
        for keys, offsets, sizes in batches:
            fresh = [f"{key}-again" for key in keys]
            exist = store.batch_is_exist(fresh)
            missing = [index for index, found in enumerate(exist) if found != 1]
            results = store.batch_put_from(
                [fresh[index] for index in missing],
                [base + offsets[index] for index in missing],
                [sizes[index] for index in missing],
            )
            if any(result != 0 for result in results):
                sys.exit(f"batch_put_from: {results[:8]}")
        exists_then_put_gbps = total / (time.perf_counter() - started) / 1e9
        store.remove_by_regex(f"^{prefix}-", True)
        figure = {
            "set_gbps": set_gbps,
            "get_gbps": get_gbps,
            "local_set_gbps": local_set_gbps,
            "local_get_gbps": local_get_gbps,
            "exists_then_put_gbps": exists_then_put_gbps,
        }
        print(json.dumps(figure), flush=True)


main()
