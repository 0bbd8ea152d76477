"""Page keys: byte-identical to SGLang's own `get_hash_str` and namespace seed, and to the algorithm written out."""

import hashlib
import random
import subprocess
import sys
import unittest

import support  # noqa: F401  (quiets SGLang's import warnings)
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

import hicache


def reference_keys(tokens, page_size, prior=None):
    """The key chain as SGLang documents it: SHA-256 of the prior key's bytes and the page's ids (u32 LE; a page
    with an id of 2^32 or more: a 0xff byte, then u64 LE ids)."""
    keys = []
    for start in range(0, len(tokens), page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        if all(token < 2**32 for token in page):
            digest.update(b"".join(token.to_bytes(4, "little") for token in page))
        else:
            digest.update(b"\xff" + b"".join(token.to_bytes(8, "little") for token in page))
        prior = digest.hexdigest()
        keys.append(prior)
    return keys


class PageKeys(unittest.TestCase):
    def test_keys_match_sglang_on_random_sequences(self):
        rng = random.Random()
        for _ in range(200):
            page_size = rng.choice([1, 2, 16, 64])
            pages = rng.randint(0, 6)
            top = rng.choice([2**16, 2**32, 2**40])
            tokens = [rng.randrange(top) for _ in range(page_size * pages)]
            prior = rng.choice([None, hashlib.sha256(str(rng.random()).encode()).hexdigest()])
            ours = hicache.page_keys(tokens, page_size, prior)
            self.assertEqual(ours, reference_keys(tokens, page_size, prior))
            if pages:
                self.assertEqual(ours, get_hash_str(tokens, prior, page_size=page_size))

    def test_a_known_vector(self):
        # the first two pages of SGLang 0.5.2's get_hash_str([0, 1, 2147483648, 4294967295], page size 2)
        self.assertEqual(
            hicache.page_keys([0, 1, 2147483648, 4294967295], 2),
            [
                "01acecb507abfe1a354aa8064f4af5d3f1acd019e37db3c11c97523b71c76e9d",
                "2980cae880febb5d95be412a87bb93fde9fc42626ef0a4b816fb957a2812a25a",
            ],
        )

    def test_namespace_seed_matches_sglang(self):
        cases = [(None, None), ("lora-A", None), (None, "salt"), ("", ""), ("a", "b"), ("ab", None), ("é", "x" * 300)]
        for extra_key, cache_salt in cases:
            self.assertEqual(hicache.namespace_seed(extra_key, cache_salt), storage_namespace_seed(extra_key, cache_salt))
        seed = hicache.namespace_seed("lora-A")
        self.assertEqual(hicache.page_keys([5] * 4, 4, seed), get_hash_str([5] * 4, seed, page_size=4))

    def test_bad_input_is_refused_naming_the_argument(self):
        with self.assertRaisesRegex(ValueError, r"tokens\[1\]: -3 is negative"):
            hicache.page_keys([1, -3], 2)
        with self.assertRaisesRegex(ValueError, "not a whole number of pages"):
            hicache.page_keys([1, 2, 3], 2)
        with self.assertRaisesRegex(ValueError, "prior"):
            hicache.page_keys([1, 2], 2, prior="zz")
        with self.assertRaisesRegex(ValueError, "page_size"):
            hicache.page_keys([1, 2], 0)
        with self.assertRaisesRegex(ValueError, "tokens"):
            hicache.page_keys(["a"], 1)

    def test_import_needs_neither_torch_nor_sglang(self):
        code = "import sys, hicache; assert not {'torch', 'sglang'} & set(sys.modules), sorted(sys.modules)"
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    unittest.main()
