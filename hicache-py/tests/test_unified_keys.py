"""SGLang's unified L3 key scheme: hicache's plans are SGLang 0.5.23's own (`plan_unified_kv`, `namespace_digest`)
on random deployments, valid and not, down to the MessagePack the digest hashes."""

import json
import random
import unittest

import msgspec
import support  # noqa: F401  (quiets SGLang's import warnings)
from sglang.srt.mem_cache import hicache_key_scheme as scheme

import hicache


def random_deployment(rng):
    """Arguments of `plan_unified_kv`: mostly valid, some out of SGLang's rules (never negative: hicache reads the
    fields as unsigned, so a negative one is refused before the checks SGLang makes first)."""
    tp = rng.choice([1, 2, 3, 4, 8])
    layers = rng.choice([1, 2, 5, 32, 61, 126])
    start = rng.randrange(layers)
    return dict(
        model_id=rng.choice(["meta-llama/Llama-3.1-8B-Instruct", "m", "", "模型", "x" * 300]),
        dtype=rng.choice(["bfloat16", "float8_e4m3fn", "float8_e5m2", "f" * 40]),
        page_size=rng.choice([0, 1, 32, 64, 65536, 2**33]),
        rank_replicated=rng.random() < 0.25,
        local_kv_heads=rng.choice([0, 1, 2, 4, 6, 8]),
        attn_tp_rank=rng.randrange(tp),
        attn_tp_size=tp,
        attn_cp_size=rng.choice([1, 1, 1, 1, 2]),
        start_layer=start,
        end_layer=rng.choice([start, layers, min(layers, start + rng.randint(1, 9))]),
        is_final_stage=rng.random() < 0.7,
        head_group=rng.choice([None, None, 0, 1, 2, 3, 4, 8]),
        layer_partition=rng.choice([None, None, 0, 1, 2, 3, 4, 16]),
    )


class UnifiedKeys(unittest.TestCase):
    def test_plans_match_sglang_on_random_deployments(self):
        rng = random.Random()
        planned = refused = 0
        for _ in range(400):
            args = random_deployment(rng)
            what = json.dumps(args)
            try:
                expected = scheme.plan_unified_kv(**args)
            except (ValueError, NotImplementedError) as raised:
                with self.assertRaises(type(raised), msg=what):
                    hicache.unified_plan(what)
                refused += 1
                continue
            ours = hicache.unified_plan(what)
            self.assertEqual(ours["encoded"], msgspec.msgpack.encode(expected.namespace).hex(), what)
            self.assertEqual(ours["digest"], scheme.namespace_digest(expected.namespace), what)
            self.assertEqual(ours["suffixes"], expected.suffixes, what)
            self.assertEqual([tuple(pair) for pair in ours["layer_ranges"]], list(expected.layer_ranges), what)
            self.assertEqual([tuple(pair) for pair in ours["head_ranges"]], list(expected.head_ranges), what)
            planned += 1
        print(f"\nunified key plans: {planned} as SGLang's, {refused} refused as SGLang refuses them")
        self.assertGreater(planned, 50)
        self.assertGreater(refused, 50)


if __name__ == "__main__":
    unittest.main()
