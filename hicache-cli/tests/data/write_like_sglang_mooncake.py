"""Writes pages into a Mooncake store as SGLang's Mooncake backend does, with Mooncake's official Python client.

SGLang keeps its host pool page-first and stores one object per page and part: a page's K (and V) is one
contiguous blob of `page_size x layers x item` bytes, put under a key SGLang builds from the page hash:

* 0.5.2: MHA `{hash}_{tp_rank}_k` / `{hash}_{tp_rank}_v`, MLA `{hash}_k`;
* 0.5.23: a prefix of the backend tag and the model (`/` -> `-`) joined by `_`, then `_{hash}`; MHA
  `{prefix}_{hash}_{tp_rank}_k` / `_v`, MLA `{prefix}_{hash}__k` (no pipeline stages here).

Argument: a JSON object with master, release, model, tag, tp_rank, mla, part_bytes, hashes, out. Writes random bytes,
saves the flat pages (each page's parts concatenated, pages in hash order) to `out`, prints `ready`, and keeps the
client (whose segment holds the objects) alive until stdin closes.
"""

import ctypes
import json
import os
import sys

from mooncake.store import MooncakeDistributedStore


def sglang_keys(release, model, tag, tp_rank, mla, page_hash):
    if release == "0.5.2":
        return [f"{page_hash}_k"] if mla else [f"{page_hash}_{tp_rank}_k", f"{page_hash}_{tp_rank}_v"]
    parts = []
    if tag is not None:
        parts.append(str(tag))
    if model:
        parts.append("-".join(model.split("/")))
    base = f"{'_'.join(parts)}_{page_hash}" if parts else page_hash
    return [f"{base}__k"] if mla else [f"{base}_{tp_rank}_k", f"{base}_{tp_rank}_v"]


def main():
    spec = json.loads(sys.argv[1])
    store = MooncakeDistributedStore()
    status = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", spec["master"])
    if status != 0:
        sys.exit(f"setup failed: {status}")
    part_bytes = spec["part_bytes"]
    keys = []
    for page_hash in spec["hashes"]:
        keys.extend(sglang_keys(spec["release"], spec["model"], spec.get("tag"), spec["tp_rank"], spec["mla"], page_hash))
    data = os.urandom(part_bytes * len(keys))
    buffer = ctypes.create_string_buffer(data, len(data))
    base = ctypes.addressof(buffer)
    if store.register_buffer(base, len(data)) != 0:
        sys.exit("register_buffer failed")
    results = store.batch_put_from(keys, [base + i * part_bytes for i in range(len(keys))], [part_bytes] * len(keys))
    if any(result != 0 for result in results):
        sys.exit(f"batch_put_from: {results}")
    with open(spec["out"], "wb") as out:
        out.write(data)
    print("ready", flush=True)
    sys.stdin.read()


main()
