"""A KV router's lookup for a hybrid model, from the L3 layout alone (SGLang's shape, as
`describe_l3_object_layout` serves it), in a process of its own with Mooncake's official Python client: which prefix
lengths of a run of pages the store can restore, every pool's hit policy applied to the objects the master holds.

Argument: JSON of `master` (host:port), `official` (the directory of Mooncake's official Python client), `layout`
and `hashes` (the run's page hashes, in order). Prints a JSON list of the restorable lengths.
"""

import json
import sys


def main():
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["official"])
    from mooncake.store import MooncakeDistributedStore

    layout, hashes = spec["layout"], spec["hashes"]
    if not layout["enabled"]:
        sys.exit(f"the layout is disabled: {layout.get('reason')}")
    inner = layout["hicache_object_layout"]
    prefix = inner["key_prefix"]
    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", spec["master"]) != 0:
        sys.exit("setup failed")

    def held(pool, page):
        """Whether every object of `pool` for page `page` is in the store."""
        for suffix in pool["suffixes"]:
            key = hashes[page] + suffix if prefix is None else f"{prefix}_{hashes[page]}{suffix}"
            answer = store.is_exist(key)
            if answer < 0:
                sys.exit(f"is_exist({key}) failed: {answer}")
            if answer != 1:
                return False
        return True

    restorable = []
    for length in range(1, len(hashes) + 1):
        whole = True
        for pool in inner["pools"]:
            if pool["hit_policy"] == "all_pages":
                first = 0
            elif pool["hit_policy"] == "trailing_pages":
                first = max(0, length - pool["trailing_pages"])
            else:
                sys.exit(f"hit policy {pool['hit_policy']}")
            whole = whole and all(held(pool, page) for page in range(first, length))
        if whole:
            restorable.append(length)
    print(json.dumps(restorable), flush=True)
    store.close()


main()
