"""The L3 key layout routers read: hicache joins the layouts of several schedulers as SGLang 0.5.23's own
`merge_l3_layouts` does, on random sets of layouts (stages missing, doubled, disagreeing, disabled), and a backend
whose objects are not found by name outside hicache says so in SGLang's shape."""

import random
import unittest

import support
from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout, merge_l3_layouts

import hicache
from hicache.sglang import HiCacheStorage


def random_layout(rng):
    """A scheduler's reply: mostly enabled stages of a few deployments, some disabled, some absent."""
    if rng.random() < 0.1:
        return None
    if rng.random() < 0.15:
        return disabled_l3_layout(
            rng.choice(["Mooncake storage is not attached", "Hierarchical cache is disabled"]),
            backend=rng.choice([None, "file", "mooncake"]),
            page_size=rng.choice([None, 16, 64]),
        )
    pp_size = rng.choice([1, 2, 3])
    pools = [
        {"pool": "kv", "suffixes": rng.sample(["_0_k", "_1_k", "__k", "_0_v"], rng.randint(1, 2)), "hit_policy": "all_pages"}
        for _ in range(rng.randint(1, 2))
    ]
    layout = {
        "enabled": rng.random() < 0.9,
        "backend": "mooncake",
        "page_size": rng.choice([16, 64]),
        "hicache_object_layout": {
            "pools": pools,
            "key_prefix": rng.choice([None, "org-Model"]),
            "is_mla_backend": rng.random() < 0.8,
            "pp_rank": rng.randrange(pp_size),
            "pp_size": pp_size,
        },
    }
    if not layout["enabled"]:
        layout["reason"] = "External L3 lookup requires rank-replicated/MLA pools"
    return layout


def schedulers(rng):
    """Replies of one engine's schedulers: often every stage of one deployment (each maybe twice), else a mix."""
    if rng.random() < 0.5:
        base = random_layout(rng)
        if base is None or "pp_rank" not in base["hicache_object_layout"]:
            return [base]
        pp_size = base["hicache_object_layout"]["pp_size"]
        replies = []
        for stage in range(pp_size):
            reply = {**base, "hicache_object_layout": {**base["hicache_object_layout"], "pp_rank": stage}}
            reply["hicache_object_layout"]["pools"] = [
                {"pool": "kv", "suffixes": [f"_{stage}_k"], "hit_policy": "all_pages"}
            ]
            replies.extend([reply] * rng.randint(1, 2))
        if rng.random() < 0.3:
            replies.pop(rng.randrange(len(replies)))
        rng.shuffle(replies)
        return replies
    return [random_layout(rng) for _ in range(rng.randint(0, 4))]


class L3Layout(support.TempDirTest):
    def test_merges_as_sglang_does_on_random_replies(self):
        seed = random.randrange(2**32)
        rng = random.Random(seed)
        outcomes = set()
        for case in range(600):
            replies = schedulers(rng)
            expected = merge_l3_layouts(replies)
            with self.subTest(seed=seed, case=case):
                self.assertEqual(hicache.merge_l3_layouts(replies), expected, replies)
            outcomes.add("none" if expected is None else expected.get("reason", "joined"))
        # the draws reach every outcome SGLang's merge has
        for outcome in (
            "none",
            "joined",
            "Inconsistent HiCache L3 layouts across schedulers",
            "Incomplete pipeline-parallel stage layouts",
        ):
            self.assertIn(outcome, outcomes, f"seed {seed}")

    def test_a_file_tier_serves_no_layout_and_says_why(self):
        backend = HiCacheStorage(support.storage_config({**support.MODULE, "dir": self.dir}), {})
        self.assertEqual(backend.describe_l3_object_layout(page_size=16)["reason"], "no host pool is registered yet")
        pool = support.mha_pool("page_first")
        backend.register_mem_pool_host(pool)
        layout = backend.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=None, page_size=16)
        self.assertEqual(
            (layout["enabled"], layout["backend"], layout["hicache_object_layout"]), (False, "file", {"pools": []})
        )
        self.assertIn("not found by name outside hicache", layout["reason"])
        backend.close()


if __name__ == "__main__":
    unittest.main()
