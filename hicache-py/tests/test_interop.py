"""One directory, two backends: pages SGLang's own `HiCacheFile` wrote are read by hicache (format `sglang`), and
the reverse, for MHA and MLA pools in every layout, and with pipeline stages."""

import unittest

import support
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

from hicache.sglang import HiCacheStorage


class SharedDirectory(support.TempDirTest):
    def both(self, pool, mla, **rank):
        sglang = HiCacheFile(support.storage_config({"file_storage_path": self.dir}, mla=mla, **rank))
        ours = HiCacheStorage(
            support.storage_config({**support.MODULE, "dir": self.dir, "format": "sglang"}, mla=mla, **rank), {}
        )
        ours.register_mem_pool_host(pool)
        self.addCleanup(ours.close)
        return sglang, ours

    def cases(self):
        for layout in support.LAYOUTS:
            yield f"mha/{layout}", support.mha_pool(layout), False
            yield f"mla/{layout}", support.mla_pool(layout), True

    def test_hicache_reads_what_sglang_wrote(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for name, pool, mla in self.cases():
            with self.subTest(pool=name):
                sglang, ours = self.both(pool, mla)
                support.randomize(pool, int(torch.randint(0, 2**31, (1,), generator=generator)))
                page_size = pool.page_size
                keys = support.random_keys(6, generator)
                sources, targets = [3, 8, 1, 12, 5, 9], [20, 21, 22, 23, 24, 25]
                # as SGLang's controller backs pages up to a file backend (its generic path)
                flat = [pool.get_data_page(page * page_size, flat=True) for page in sources]
                self.assertTrue(sglang.batch_set(keys, flat))
                expected = [page.clone() for page in flat]
                pool.kv_buffer.zero_()
                self.assertEqual(ours.batch_exists(keys), len(keys))
                self.assertEqual(ours.batch_get_v1(keys, support.page_indices(targets, page_size)), [True] * len(keys))
                for target, want in zip(targets, expected):
                    self.assertTrue(support.same_bytes(pool.get_data_page(target * page_size, flat=True), want))

    def test_sglang_reads_what_hicache_wrote(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for name, pool, mla in self.cases():
            with self.subTest(pool=name):
                sglang, ours = self.both(pool, mla)
                support.randomize(pool, int(torch.randint(0, 2**31, (1,), generator=generator)))
                page_size = pool.page_size
                keys = support.random_keys(6, generator)
                sources, targets = [2, 4, 6, 8, 10, 12], [30, 29, 28, 27, 26, 25]
                expected = [pool.get_data_page(page * page_size, flat=True).clone() for page in sources]
                self.assertEqual(ours.batch_set_v1(keys, support.page_indices(sources, page_size)), [True] * len(keys))
                pool.kv_buffer.zero_()
                self.assertTrue(all(sglang.exists(key) for key in keys))
                # as SGLang's controller prefetches from a file backend (its generic path)
                pages = sglang.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
                for target, page, want in zip(targets, pages, expected):
                    self.assertIsNotNone(page)
                    pool.set_from_flat_data_page(target * page_size, page)
                    self.assertTrue(support.same_bytes(pool.get_data_page(target * page_size, flat=True), want))

    def test_pipeline_stages_keep_apart_as_in_sglang(self):
        pool = support.mha_pool("page_first")
        support.randomize(pool, 4)
        keys = support.random_keys(2, torch.Generator().manual_seed(4))
        for stage in (0, 1):
            config = dict(support.MODULE, dir=self.dir, format="sglang")
            storage_config = support.storage_config(config)
            storage_config.pp_rank, storage_config.pp_size = stage, 2
            ours = HiCacheStorage(storage_config, {})
            ours.register_mem_pool_host(pool)
            self.assertEqual(ours.batch_set_v1(keys, support.page_indices([stage, stage + 2], 16)), [True, True])
            sglang_config = support.storage_config({"file_storage_path": self.dir})
            sglang_config.pp_rank, sglang_config.pp_size = stage, 2
            sglang = HiCacheFile(sglang_config)
            want = pool.get_data_page(stage * 16, flat=True)
            got = sglang.get(keys[0], pool.get_dummy_flat_data_page())
            self.assertTrue(support.same_bytes(got, want), f"stage {stage}")
            ours.close()


if __name__ == "__main__":
    unittest.main()
