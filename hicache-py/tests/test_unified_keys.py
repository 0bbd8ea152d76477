"""SGLang's unified L3 key scheme: hicache's plans are SGLang 0.5.23's own (`plan_unified_kv`, `namespace_digest`)
on random deployments, valid and not, down to the MessagePack the digest hashes."""

import json
import random
import unittest

import msgspec
import support
import torch
from sglang.srt.mem_cache import hicache_key_scheme as scheme

import hicache
from hicache.sglang import HiCacheStorage


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
        # Fresh cases each run, drawn until each side has enough of them: about one draw in six plans, so a fixed
        # number of draws would leave the count of valid plans to chance.
        rng = random.Random()
        planned = refused = draws = 0
        while (planned < 100 or refused < 100) and draws < 20_000:
            draws += 1
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
        print(f"\nunified key plans: {planned} as SGLang's, {refused} refused as SGLang refuses them ({draws} draws)")
        self.assertGreaterEqual(planned, 100)
        self.assertGreaterEqual(refused, 100)


class UnifiedChunks(support.TempDirTest):
    """SGLang's own `page_unified` host pools storing through hicache under `key_scheme: unified`: what two TP2 ranks
    stored, a TP1 rank reads, its page being the two ranks' page blocks one after the other (head groups are the
    block's outermost axis, and rank 0 holds the first half of the heads)."""

    LAYERS, HEADS, HEAD_DIM, PAGE = 4, 4, 64, 16

    def backend(self, pool, rank, size, **extra):
        extra = {**support.MODULE, "backend": "file", "dir": self.dir, "key_scheme": "unified", **extra}
        backend = HiCacheStorage(support.storage_config(extra, tp_rank=rank, tp_size=size), {})
        backend.register_mem_pool_host(pool)
        self.addCleanup(backend.close)
        return backend

    def pool(self, tp_size):
        heads = self.HEADS // tp_size
        # one KV head per chunk: the pool's page in as many groups as it has heads
        return support.mha_pool(
            "page_unified", layers=self.LAYERS, heads=heads, head_dim=self.HEAD_DIM, page_size=self.PAGE,
            head_group_num=heads,
        )

    def test_a_tp1_rank_reads_the_pages_two_tp2_ranks_stored(self):
        generator = torch.Generator().manual_seed(torch.seed())
        keys = support.random_keys(6, generator)
        sources = list(range(1, 7))
        blocks = []
        for rank in range(2):
            pool = self.pool(2)
            support.randomize(pool, int(torch.randint(0, 2**31, (1,), generator=generator)))
            backend = self.backend(pool, rank, 2, head_group=1, layer_partition=2)
            self.assertEqual(backend.batch_set_v1(keys, support.page_indices(sources, self.PAGE)), [True] * 6)
            blocks.append([pool.kv_buffer[page].clone() for page in sources])
            # small pages are written behind by default; closing the rank waits until they are written
            backend.close()
        reader = self.pool(1)
        reader.kv_buffer.zero_()
        backend = self.backend(reader, 0, 1, head_group=1, layer_partition=2)
        self.assertEqual(backend.batch_exists(keys), 6)
        targets = list(range(7, 13))
        self.assertEqual(backend.batch_get_v1(keys, support.page_indices(targets, self.PAGE)), [True] * 6)
        for index, page in enumerate(targets):
            expected = torch.cat([blocks[0][index].reshape(-1), blocks[1][index].reshape(-1)])
            self.assertTrue(support.same_bytes(reader.kv_buffer[page].reshape(-1), expected), f"page {page}")
        # another grid (two layers per chunk is the fleet's agreement) finds nothing
        other = self.backend(self.pool(1), 0, 1, head_group=1, layer_partition=4)
        self.assertEqual(other.batch_exists(keys), 0)

    def test_agreements_without_the_scheme_and_pools_that_are_not_page_unified_are_refused(self):
        with self.assertRaisesRegex(ValueError, "head_group"):
            HiCacheStorage(support.storage_config({**support.MODULE, "dir": self.dir, "head_group": 1}), {})
        backend = HiCacheStorage(
            support.storage_config({**support.MODULE, "dir": self.dir, "key_scheme": "unified"}), {}
        )
        self.addCleanup(backend.close)
        with self.assertRaisesRegex(ValueError, "mem_layout"):
            backend.register_mem_pool_host(support.mha_pool("page_first"))

    def test_a_later_stage_whose_pool_does_not_say_its_first_layer_is_refused(self):
        # the chunks are named by absolute layers: stage 1 must not name its chunks as stage 0's
        extra = {**support.MODULE, "dir": self.dir, "key_scheme": "unified", "head_group": 1}
        backend = HiCacheStorage(support.storage_config(extra, pp=(1, 2)), {})
        self.addCleanup(backend.close)
        pool = self.pool(1)
        pool.start_layer = None
        with self.assertRaisesRegex(ValueError, "start_layer"):
            backend.register_mem_pool_host(pool)
        # a stage that says where it starts is served
        served = HiCacheStorage(support.storage_config(extra, pp=(1, 2)), {})
        self.addCleanup(served.close)
        served.register_mem_pool_host(self.pool(1))


if __name__ == "__main__":
    unittest.main()
