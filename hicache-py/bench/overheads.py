"""What hicache's Python face costs per request, beside the same work's floor in the same run.

A request of a 2k-token prompt whose prefix is on the host converts its token ids once (``hicache.cache.token_ids``,
as ``Engine.serve`` does) and runs ``Cache.match``, ``Cache.load`` (the load back to the device) and ``Cache.insert``
with them; the device is emptied between requests (not timed). The same with the ids passed as a list at each call
is printed beside it. The KV is tiny (one layer, one head
of 8 dims, 32 bytes a token), so the copies cost nearly nothing and what is timed is the cache's own work from Python:
the tree walks, the page bookkeeping, the crossings into Rust. Beside it: ``hicache.page_keys`` of the same prompt
(the page hashing every prefix cache pays) and a bare Python call into the native module.

    python hicache-py/bench/overheads.py
"""

from __future__ import annotations

import statistics
import time

import torch

import hicache
from hicache import _native
from hicache.cache import Cache, token_ids

PROMPT = 2048
PAGE = 16
REQUESTS = 200


def main():
    k = [torch.zeros(8 * PROMPT, 1, 8, dtype=torch.float16)]
    v = [torch.zeros(8 * PROMPT, 1, 8, dtype=torch.float16)]
    cache = Cache({"page_size": PAGE, "mem_layout": "page_first", "hicache_ratio": 2.0, "load_back_threshold": 1}, k, v)
    tokens = torch.randint(0, 1 << 17, (PROMPT,)).tolist()
    cache.insert(tokens, cache.alloc(PROMPT))
    per_request = {"once": [], "list": []}
    for request in range(2 * REQUESTS):
        way = "once" if request % 2 else "list"
        cache.drain()
        cache.evict(cache.slots)
        started = time.perf_counter()
        ids = token_ids(tokens) if way == "once" else tokens
        matched = cache.match(ids)
        load = cache.load(ids)
        for layer in range(cache.layers):
            load.wait_layer(layer)
        cache.insert(ids, load.slots, load)
        per_request[way].append(time.perf_counter() - started)
        assert matched.host_tokens == PROMPT and load.loaded == PROMPT
    cache.close()
    hashing = []
    for _ in range(REQUESTS):
        started = time.perf_counter()
        hicache.page_keys(tokens, PAGE)
        hashing.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(REQUESTS * 10):
        _native.namespace_seed(None, None)
    bare = (time.perf_counter() - started) / (REQUESTS * 10)
    request_us = statistics.median(per_request["once"]) * 1e6
    list_us = statistics.median(per_request["list"]) * 1e6
    hashing_us = statistics.median(hashing) * 1e6
    print(f"match + load back + insert of a {PROMPT}-token prompt from Python: {request_us:.0f} us per request "
          f"(median of {REQUESTS}; {list_us:.0f} us with the ids as a list at each call); hashing its pages alone: {hashing_us:.0f} us ({request_us / hashing_us:.2f}x); "
          f"a bare call into the native module: {bare * 1e6:.2f} us")


if __name__ == "__main__":
    main()
