#!/usr/bin/env python3
"""SGLang 0.5.2's HiCacheFile layout, written and read the way HiCacheFile does, for hicache's compatibility tests.

    sglang_file_layout.py write DIR MODEL TP_RANK TP_SIZE MLA PAGE_SIZE PAGE_BYTES PAGES
    sglang_file_layout.py check DIR MODEL TP_RANK TP_SIZE MLA PAGE_SIZE PAGE_BYTES PAGES

Pages: the tokens of page p are [1000 * p + j for j in range(PAGE_SIZE)], chained from the first page with
SGLang's get_hash_str rule; byte i of page p is (p * 131 + i * 7 + (i >> 8)) & 0xff. MLA is 0 or 1.

`write` does what HiCacheFile.set does for each page: path f"{dir}/{hash}{suffix}.bin", with suffix
f"_{model}" for MLA else f"_{model}_{tp_rank}_{tp_size}" and "/" in the model replaced by "-"; the raw bytes
written with tofile. `check` does what HiCacheFile.get does: open(path, "rb", buffering=0).readinto(buffer of
PAGE_BYTES), where a short read is an error; and compares the bytes.
"""
import hashlib
import os
import sys


def get_hash_str(token_ids, prior_hash=None):
    # SGLang 0.5.2, sglang/srt/mem_cache/hicache_storage.py (the same rule: raw prior digest, then u32 LE tokens)
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def pages(page_size, page_bytes, count):
    last = None
    for p in range(count):
        last = get_hash_str([1000 * p + j for j in range(page_size)], last)
        yield last, bytes((p * 131 + i * 7 + (i >> 8)) & 0xFF for i in range(page_bytes))


def main():
    command, folder, model, tp_rank, tp_size, mla, page_size, page_bytes, count = sys.argv[1:]
    model = "-".join(model.split("/")) if model else ""
    suffix = f"_{model}" if mla == "1" else f"_{model}_{tp_rank}_{tp_size}"
    for key, data in pages(int(page_size), int(page_bytes), int(count)):
        path = os.path.join(folder, f"{key}{suffix}.bin")
        if command == "write":
            with open(path, "wb") as out:
                out.write(data)
        elif command == "check":
            buffer = bytearray(int(page_bytes))
            with open(path, "rb", buffering=0) as source:
                read = source.readinto(memoryview(buffer))
            if read != len(buffer):
                raise IOError(f"{path}: short read, {read} of {len(buffer)} bytes")
            if bytes(buffer) != data:
                raise ValueError(f"{path}: bytes differ")
        else:
            raise SystemExit(f"unknown command {command}")
    print(f"{command}: {count} pages ok")


if __name__ == "__main__":
    main()
