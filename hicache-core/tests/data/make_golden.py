#!/usr/bin/env python3
"""Golden page keys made by SGLang 0.5.2's own get_hash_str.

Command that made sglang_0_5_2_page_keys.json (run from the repository root; needs pip and PyPI):

    python3 hicache-core/tests/data/make_golden.py > hicache-core/tests/data/sglang_0_5_2_page_keys.json

It downloads the sglang==0.5.2 wheel (no dependencies), takes the `get_hash_str` function out of
sglang/srt/mem_cache/hicache_storage.py unchanged (the module itself imports torch, so it is not imported whole),
and chains it over pages exactly as cache_controller._storage_hit_query and HiRadixCache.insert do:
`for i in range(0, len(tokens), page_size): last = get_hash_str(tokens[i:i + page_size], last)`.
A trailing short page is hashed as it is (what that loop does when given one).
"""
import ast
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_VERSION = "0.5.2"
SOURCE = "sglang/srt/mem_cache/hicache_storage.py"


def load_get_hash_str():
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={WHEEL_VERSION}", "-d", folder],
            check=True,
        )
        wheel = next(Path(folder).glob("sglang-*.whl"))
        wheel_sha256 = hashlib.sha256(wheel.read_bytes()).hexdigest()
        with zipfile.ZipFile(wheel) as archive:
            source = archive.read(SOURCE).decode()
    tree = ast.parse(source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "get_hash_str")
    module = ast.Module(body=[function], type_ignores=[])
    namespace = {"hashlib": hashlib, "List": list}
    exec(compile(module, SOURCE, "exec"), namespace)
    return namespace["get_hash_str"], wheel.name, wheel_sha256, ast.get_source_segment(source, function)


def chain(get_hash_str, tokens, page_size, prior):
    keys, last = [], prior
    for i in range(0, len(tokens), page_size):
        last = get_hash_str(tokens[i : i + page_size], last)
        keys.append(last)
    return keys


def main():
    get_hash_str, wheel, wheel_sha256, function_source = load_get_hash_str()
    rng = random.Random(20261130)
    cases = []

    def add(name, tokens, page_size, prior=None):
        cases.append(
            {"name": name, "page_size": page_size, "prior": prior, "tokens": tokens,
             "keys": chain(get_hash_str, tokens, page_size, prior)}
        )

    add("empty page, no prior", [], 1)
    add("one zero token", [0], 1)
    add("largest token id", [2**32 - 1], 1)
    add("edge tokens, page 2", [0, 1, 2**31, 2**32 - 1], 2)
    for page_size in (1, 2, 3, 16, 64):
        for length in (page_size, 4 * page_size, 17 * page_size):
            tokens = [rng.randrange(0, 200_000) for _ in range(length)]
            add(f"random vocab tokens, page {page_size}, {length} tokens", tokens, page_size)
    for page_size in (1, 16, 64):
        prior = hashlib.sha256(rng.randbytes(32)).hexdigest()
        tokens = [rng.randrange(0, 2**32) for _ in range(5 * page_size)]
        add(f"full-range tokens after a prior key, page {page_size}", tokens, page_size, prior)
    add("partial last page, page 64", [rng.randrange(0, 128_000) for _ in range(64 * 3 + 10)], 64)
    add("partial last page after a prior, page 16", [rng.randrange(0, 128_000) for _ in range(16 + 5)], 16,
        hashlib.sha256(b"prior").hexdigest())
    add("long conversation, page 64", [rng.randrange(0, 128_000) for _ in range(64 * 200)], 64)

    rejected = []
    for token in (2**32, -1):
        try:
            get_hash_str([1, token])
        except OverflowError as error:
            rejected.append({"tokens": [1, token], "error": f"OverflowError: {error}"})

    json.dump(
        {
            "made_by": "hicache-core/tests/data/make_golden.py",
            "sglang_wheel": wheel,
            "sglang_wheel_sha256": wheel_sha256,
            "get_hash_str_source": function_source,
            "chaining": "for i in range(0, len(tokens), page_size): last = get_hash_str(tokens[i:i+page_size], last)",
            "cases": cases,
            "rejected_by_sglang": rejected,
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
