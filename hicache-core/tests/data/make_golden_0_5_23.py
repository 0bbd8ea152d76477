#!/usr/bin/env python3
"""Golden page keys of SGLang 0.5.23's newer key rules, made by SGLang's own code.

Command that made sglang_0_5_23_page_keys.json (run from the repository root; needs pip, PyPI, g++ and OpenSSL's
libcrypto headers):

    python3 hicache-core/tests/data/make_golden_0_5_23.py > hicache-core/tests/data/sglang_0_5_23_page_keys.json

It downloads the sglang==0.5.23 wheel (no dependencies) and pybind11, and uses, unchanged:
* `storage_namespace_seed(extra_key, cache_salt)` from sglang/srt/mem_cache/utils.py (taken out of the module with
  `ast`, as the module itself imports torch): the first page's prior of a request with an extra key or a salt;
* the C++ page hasher SGLang compiles at run time, sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, built here into
  a Python module with g++ (SGLang builds the same file with torch's extension loader), called as SGLang's
  `get_native_hash` calls it, with the token ids in an unsigned 64-bit array so ids of 2^32 and more reach it.
"""
import ast
import hashlib
import json
import random
import subprocess
import sys
import sysconfig
import tempfile
import typing
import zipfile
from array import array
from pathlib import Path

WHEEL_VERSION = "0.5.23"
SEED_SOURCE = "sglang/srt/mem_cache/utils.py"
HASHER_SOURCE = "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"


def load_sglang(folder):
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", folder]
    subprocess.run([*pip, f"sglang=={WHEEL_VERSION}"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", f"{folder}/pyb", "pybind11"],
                   check=True)
    wheel = next(Path(folder).glob("sglang-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        seed_source = archive.read(SEED_SOURCE).decode()
        (Path(folder) / "hash_binding.cpp").write_bytes(archive.read(HASHER_SOURCE))
    tree = ast.parse(seed_source)
    function = next(
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "storage_namespace_seed"
    )
    namespace = {"hashlib": hashlib, "Optional": typing.Optional}
    exec(compile(ast.Module(body=[function], type_ignores=[]), SEED_SOURCE, "exec"), namespace)
    sys.path.insert(0, f"{folder}/pyb")
    import pybind11

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        ["g++", "-O2", "-shared", "-fPIC", "-std=c++17", "-DTORCH_EXTENSION_NAME=hicache_hash_cpp",
         f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"{folder}/hash_binding.cpp",
         "-o", f"{folder}/hicache_hash_cpp{suffix}", "-lcrypto", "-Wno-deprecated-declarations"],
        check=True,
    )
    sys.path.insert(0, folder)
    import hicache_hash_cpp

    return namespace["storage_namespace_seed"], hicache_hash_cpp, wheel.name, hashlib.sha256(wheel.read_bytes())


def main():
    with tempfile.TemporaryDirectory() as folder:
        seed_of, hasher, wheel, wheel_sha256 = load_sglang(folder)

        def keys(tokens, page_size, prior):
            digest = bytes.fromhex(prior) if prior else None
            return hasher.get_hash(array("Q", tokens), len(tokens), 1, False, digest, page_size)

        rng = random.Random(20261201)
        seeds = []
        for extra_key, cache_salt in [("lora-A", None), (None, "s1"), ("lora-A", "s1"), ("", None), (None, ""),
                                      ("", ""), ("ab", None), ("a", "b"), ("模型/适配器", "盐")]:
            seeds.append({"extra_key": extra_key, "cache_salt": cache_salt, "seed": seed_of(extra_key, cache_salt)})
        cases = []

        def add(name, tokens, page_size, extra_key=None, cache_salt=None, prior=None):
            # SGLang's storage chains start from the seed when no prior is given (get_storage_hash_str)
            start = prior if prior is not None else seed_of(extra_key, cache_salt)
            cases.append({"name": name, "page_size": page_size, "extra_key": extra_key, "cache_salt": cache_salt,
                          "prior": prior, "tokens": tokens, "keys": keys(tokens, page_size, start)})

        add("tokens 0..63 with extra key lora-A, page 64", list(range(64)), 64, extra_key="lora-A")
        add("random tokens with a salt, page 16", [rng.randrange(0, 200_000) for _ in range(16 * 5)], 16,
            cache_salt="tenant-7")
        add("random tokens with both, page 1", [rng.randrange(0, 200_000) for _ in range(9)], 1, "lora-B", "x")
        add("no extra key and no salt: the 0.5.2 keys", [0, 1, 2**31, 2**32 - 1], 2)
        add("one wide page between narrow ones, page 2", [1, 2, 2**32, 3, 5, 6], 2)
        add("the largest id SGLang takes, page 1", [2**63 - 1], 1)
        add("wide ids after a prior, page 16",
            [rng.randrange(0, 2**63) if i % 7 == 0 else rng.randrange(0, 200_000) for i in range(16 * 4)], 16,
            prior=hashlib.sha256(b"prior").hexdigest())
        add("a wide short last page, page 4", [7, 8, 9, 10, 11, 2**40], 4)
        add("wide ids with an extra key, page 3", [2**33, 1, 2, 3, 4, 2**62], 3, extra_key="lora-A")
        rejected = []
        for token in (2**63, 2**64 - 1):
            try:
                keys([1, token], 1, None)
            except (OverflowError, ValueError, IndexError) as error:
                rejected.append({"tokens": [1, token], "error": f"{type(error).__name__}: {error}"})
        json.dump(
            {
                "made_by": "hicache-core/tests/data/make_golden_0_5_23.py",
                "sglang_wheel": wheel,
                "sglang_wheel_sha256": wheel_sha256.hexdigest(),
                "seeds": seeds,
                "cases": cases,
                "rejected_by_sglang": rejected,
            },
            sys.stdout,
            indent=1,
            ensure_ascii=False,
        )
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
