"""A KV router's lookup, as a router outside the engine makes it: from the L3 layout alone (the JSON `hicache store
layout` prints, SGLang's shape), the object keys of each page, asked of the Mooncake master with Mooncake's official
Python client.

Arguments: the master's address, the layout (JSON text), then page hashes (64 hex digits each). Prints a JSON list:
for each page, the number of its objects present and the number it has.
"""

import hashlib
import json
import sys

from mooncake.store import MooncakeDistributedStore


def object_keys(layout, page_hash):
    """Every object key of the page `page_hash`, as the layout names them."""
    inner = layout["hicache_object_layout"]
    prefix = inner["key_prefix"]
    keys = []
    for pool in inner["pools"]:
        objects = pool.get("objects")
        for index, suffix in enumerate(pool["suffixes"]):
            key = page_hash + suffix if prefix is None else f"{prefix}_{page_hash}{suffix}"
            if objects is None:
                keys.append(key)
                continue
            # the unified key scheme: the chunk's key string, hashed, named by the tier
            chunk = hashlib.sha256(key.encode()).hexdigest()
            named = objects[index]
            head = "" if named["key_prefix"] is None else f"{named['key_prefix']}_"
            keys.extend(head + chunk + object_suffix for object_suffix in named["suffixes"])
    return keys


def main():
    master, layout, hashes = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    if not layout["enabled"]:
        sys.exit(f"the layout is disabled: {layout.get('reason')}")
    store = MooncakeDistributedStore()
    status = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master)
    if status != 0:
        sys.exit(f"setup failed: {status}")
    found = []
    for page_hash in hashes:
        keys = object_keys(layout, page_hash)
        answers = [store.is_exist(key) for key in keys]
        if any(answer < 0 for answer in answers):
            sys.exit(f"is_exist failed: {answers}")
        found.append([sum(answers), len(keys)])
    print(json.dumps(found))
    store.close()


main()
