"""hicache's backend driven as SGLang drives it: loaded by SGLang's factory, over SGLang's own host pools."""

import threading
import unittest

import support
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as SglangStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.sglang import HiCacheStorage


def pools():
    """Every pool kind and layout hicache serves, small."""
    for layout in support.LAYOUTS:
        yield f"mha/{layout}", support.mha_pool(layout), False
        yield f"mla/{layout}", support.mla_pool(layout), True


class Backend(support.TempDirTest):
    def open(self, pool, mla, **extra):
        if extra.get("backend", "file") == "file":
            extra.setdefault("dir", self.dir)
        backend = HiCacheStorage(support.storage_config({**support.MODULE, **extra}, mla=mla), {})
        backend.register_mem_pool_host(pool)
        self.addCleanup(backend.close)
        return backend

    def test_sglang_factory_loads_the_class(self):
        pool = support.mha_pool("page_first")
        config = support.storage_config({**support.MODULE, "dir": self.dir})
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        self.assertIsInstance(backend, SglangStorage)
        self.assertIsInstance(backend, HiCacheStorage)
        backend.register_mem_pool_host(pool)
        support.randomize(pool, 1)
        keys = support.random_keys(2, torch.Generator().manual_seed(1))
        self.assertEqual(backend.batch_set_v1(keys, support.page_indices([3, 4], 16)), [True, True])
        self.assertEqual(backend.batch_exists(keys), 2)
        backend.close()

    def test_pages_round_trip_through_every_tier_pool_and_layout(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for tier in ({"backend": "file"}, {"backend": "file", "format": "sglang"}, {"backend": "memory"}):
            for name, pool, mla in pools():
                with self.subTest(tier=tier, pool=name):
                    backend = self.open(pool, mla, **tier)
                    support.randomize(pool, int(torch.randint(0, 2**31, (1,), generator=generator)))
                    page_size = pool.page_size
                    sources = torch.randperm(pool.size // page_size, generator=generator)[:12].tolist()
                    keys = support.random_keys(len(sources), generator)
                    expected = [pool.get_data_page(page * page_size).clone() for page in sources]
                    ok = backend.batch_set_v1(keys, support.page_indices(sources, page_size))
                    self.assertEqual(ok, [True] * len(keys))
                    # the third key missing: the leading run stops there, and the read says which pages arrived
                    missing = support.random_keys(1, generator)
                    asked = keys[:2] + missing + keys[2:]
                    self.assertEqual(backend.batch_exists(asked), 2)
                    pool.kv_buffer.zero_()
                    targets = [page for page in range(pool.size // page_size) if page not in sources][: len(asked)]
                    got = backend.batch_get_v1(asked, support.page_indices(targets, page_size))
                    self.assertEqual(got, [True, True, False] + [True] * (len(keys) - 2))
                    arrived = targets[:2] + targets[3:]
                    for page, want in zip(arrived, expected):
                        self.assertTrue(support.same_bytes(pool.get_data_page(page * page_size), want), f"host page {page}")
                    self.assertFalse(pool.get_data_page(targets[2] * page_size).any(), "a missed page was written")
                    stats = backend.hicache_stats()
                    self.assertEqual(stats["staging_bytes"], 0)
                    backend.clear()
                    self.assertEqual(backend.batch_exists(keys), 0)

    def test_segments_are_sglangs_page_buffer_meta(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for name, pool, mla in pools():
            with self.subTest(pool=name):
                backend = self.open(pool, mla, backend="memory")
                pages = torch.randperm(pool.size // pool.page_size, generator=generator)[:5].tolist()
                indices = support.page_indices(pages, pool.page_size)
                pointers, sizes = pool.get_page_buffer_meta(indices)
                ours = backend._backend.segments(indices.data_ptr(), indices.numel(), len(pages))
                # SGLang lists an MHA layer_first page's ranges K and V layer by layer; hicache lists all K, then all V:
                # the flat page's order, so the bytes stored are the page SGLang's own file backend stores
                per_page = len(pointers) // len(pages)
                expected = []
                for at in range(len(pages)):
                    entries = list(zip(pointers, sizes))[at * per_page : (at + 1) * per_page]
                    if not mla and pool.layout == "layer_first":
                        entries = entries[0::2] + entries[1::2]
                    expected += entries
                self.assertEqual(ours, expected)

    def test_copy_path_as_sglangs_generic_controller_uses_it(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for name, pool, mla in pools():
            with self.subTest(pool=name):
                backend = self.open(pool, mla)
                support.randomize(pool, 7)
                page_size = pool.page_size
                keys = support.random_keys(4, generator)
                sources = [1, 5, 2, 9]
                values = [pool.get_data_page(page * page_size, flat=True) for page in sources]
                expected = [value.clone() for value in values]
                self.assertTrue(backend.batch_set(keys, values))
                self.assertTrue(backend.set(keys[0], values[0]))  # already stored: still True
                pool.kv_buffer.zero_()
                dummies = [pool.get_dummy_flat_data_page() for _ in keys]
                pages = backend.batch_get(keys, dummies)
                self.assertTrue(all(page is not None for page in pages))
                for page, want in zip(pages, expected):
                    self.assertTrue(support.same_bytes(page, want))
                self.assertTrue(support.same_bytes(backend.get(keys[1]), expected[1]))
                self.assertIsNone(backend.get(support.random_keys(1, generator)[0], pool.get_dummy_flat_data_page()))
                self.assertTrue(backend.exists(keys[2]))

    def test_an_mla_rank_other_than_the_writer_stores_nothing(self):
        pool = support.mla_pool("page_first")
        support.randomize(pool, 3)
        keys = support.random_keys(2, torch.Generator().manual_seed(3))
        extra = {**support.MODULE, "dir": self.dir}
        follower = HiCacheStorage(support.storage_config(extra, mla=True, tp_rank=1, tp_size=2), {})
        follower.register_mem_pool_host(pool)
        self.assertEqual(follower.batch_set_v1(keys, support.page_indices([1, 2], 16)), [True, True])
        self.assertEqual(follower.batch_exists(keys), 0)
        writer = HiCacheStorage(support.storage_config(extra, mla=True, tp_rank=0, tp_size=2), {})
        writer.register_mem_pool_host(pool)
        self.assertEqual(writer.batch_set_v1(keys, support.page_indices([1, 2], 16)), [True, True])
        # batches of small pages are written behind by default: other processes find them once written, and closing
        # the writer waits for that
        writer.close()
        self.assertEqual(follower.batch_exists(keys), 2)  # every rank reads the writer's pages
        follower.close()

    def test_storage_metrics_reach_sglangs_metrics_object(self):
        pool = support.mha_pool("page_first")
        backend = HiCacheStorage(support.storage_config({**support.MODULE, "backend": "memory"}, metrics=True), {})
        backend.register_mem_pool_host(pool)
        keys = support.random_keys(3, torch.Generator().manual_seed(5))
        backend.batch_set_v1(keys, support.page_indices([1, 2, 3], 16))
        backend.batch_get_v1(keys, support.page_indices([4, 5, 6], 16))
        metrics = backend.get_stats()
        self.assertEqual((metrics.backup_pgs, metrics.prefetch_pgs), ([3], [3]))
        self.assertGreater(metrics.prefetch_bandwidth[0], 0)
        self.assertEqual(backend.get_stats().backup_pgs, [])  # reset by the previous call
        backend.close()

    def test_bad_host_indices_fail_the_batch_without_raising(self):
        pool = support.mha_pool("page_first")
        backend = self.open(pool, False, backend="memory")
        keys = support.random_keys(2, torch.Generator().manual_seed(6))
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(backend.batch_set_v1(keys, torch.arange(3, 3 + 32)), [False, False])  # not page-aligned
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(backend.batch_get_v1(keys, support.page_indices([1, 1], 16)), [False, False])  # twice
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(backend.batch_get_v1(keys, support.page_indices([1], 16)), [False, False])  # short
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(backend.batch_get_v1(["not-a-key", keys[0]], support.page_indices([1, 2], 16)), [False] * 2)
        unregistered = HiCacheStorage(support.storage_config({**support.MODULE, "backend": "memory"}), {})
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(unregistered.batch_get_v1(keys, support.page_indices([1, 2], 16)), [False, False])

    def test_prefetch_and_backup_threads_at_once(self):
        pool = support.mha_pool("page_first", device_tokens=1024)
        backend = self.open(pool, False)
        support.randomize(pool, 11)
        page_size, pages = pool.page_size, pool.size // pool.page_size
        generator = torch.Generator().manual_seed(torch.seed())
        half = pages // 2
        keys = support.random_keys(half, generator)
        expected = [pool.get_data_page(page * page_size).clone() for page in range(half)]
        # first half stored, then read back into the second half while a writer stores the first half again
        self.assertTrue(all(backend.batch_set_v1(keys, support.page_indices(range(half), page_size))))
        failures = []

        def writer():
            for start in range(0, half, 8):
                batch = range(start, min(start + 8, half))
                if not all(backend.batch_set_v1([keys[page] for page in batch], support.page_indices(batch, page_size))):
                    failures.append(start)

        thread = threading.Thread(target=writer)
        thread.start()
        got = backend.batch_get_v1(keys, support.page_indices(range(half, 2 * half), page_size))
        thread.join()
        self.assertEqual(failures, [])
        self.assertEqual(got, [True] * half)
        for page in range(half):
            self.assertTrue(support.same_bytes(pool.get_data_page((half + page) * page_size), expected[page]))


if __name__ == "__main__":
    unittest.main()
