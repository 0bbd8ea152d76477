"""Hybrid models through SGLang's v2 storage calls, with SGLang 0.5.23's own host pools built on the CPU: a Mamba
state pool (``trailing_pages``), a sliding-window KV pool (``trailing_pages``), a DSA indexer pool (``all_pages``) and
a draft model's KV pool (``all_pages``), each beside its KV pool. Pages round trip through SGLang's factory byte for byte per pool; a sidecar entry that is
missing, damaged or evicted between the query and the read shrinks what is restored to the last whole group; SGLang's
own ``HiCacheFile`` reads the groups hicache wrote in the ``sglang`` format, and the reverse."""

import os
import unittest

import support
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.sglang import HiCacheStorage

PAGES = 8


def mamba_pool(slots=40, layers=2, temporal=(4, 8), conv=(6, 3)):
    """SGLang's Mamba state host pool (a slot per state, page size 1) over CPU "device" state tensors: per layer a
    float32 temporal state and a bf16 conv state of the given shapes."""
    temporal = torch.zeros(layers, slots, *temporal, dtype=torch.float32)
    conv = (torch.zeros(layers, slots, *conv, dtype=torch.bfloat16),)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def dsa_pools(layout, page_size=64, tokens=40 * 64, layers=2):
    """SGLang's MLA host pool and the DSA indexer host pool laid out on it, over a CPU DSA device pool."""
    device = DSATokenToKVPool(
        size=tokens,
        page_size=page_size,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=576,
        index_buf_size=tokens + page_size,
    )
    anchor = support.mla_pool(layout, layers=layers, page_size=page_size, device_tokens=tokens)
    decl = make_dsa_indexer_pool_decl(device, name=PoolName.INDEXER)
    return anchor, DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu")


def cases():
    """(name, KV host pool, MLA or not, sidecar pool name, its host pool, its hit policy, its window in pages): a
    Mamba state, a sliding window and a DSA indexer (of either layout), and a draft model's KV beside an MHA and an
    MLA target."""
    yield "mamba", support.mha_pool("page_first"), False, PoolName.MAMBA, mamba_pool(), PoolHitPolicy.TRAILING_PAGES, 1
    for layout in ("layer_first", "page_first"):
        swa = support.mha_pool(layout, layers=1, heads=1, head_dim=32)
        yield f"swa/{layout}", support.mha_pool(layout), False, PoolName.SWA, swa, PoolHitPolicy.TRAILING_PAGES, 2
        anchor, indexer = dsa_pools(layout)
        yield f"indexer/{layout}", anchor, True, PoolName.INDEXER, indexer, PoolHitPolicy.ALL_PAGES, 0
    # a draft model's KV (EAGLE beside an MHA target, MTP beside an MLA one): every page
    draft = support.mha_pool("page_first", layers=1, heads=1, head_dim=16)
    yield "draft", support.mha_pool("page_first"), False, PoolName.DRAFT, draft, PoolHitPolicy.ALL_PAGES, 0
    draft = support.mla_pool("page_first", layers=1)
    yield "draft/mla", support.mla_pool("page_first"), True, PoolName.DRAFT, draft, PoolHitPolicy.ALL_PAGES, 0


def fill(pool, pages, generator):
    """Random bytes in the host pool's pages `pages` (through the pool's own flat-page calls)."""
    like = pool.get_dummy_flat_data_page()
    nbytes = like.numel() * like.element_size()
    for page in pages:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        pool.set_from_flat_data_page(page * pool.page_size, data.view(like.dtype))


def page(pool, index):
    return pool.get_data_page(index * pool.page_size, flat=True).clone()


def transfer(name, pool, keys, pages, policy):
    return PoolTransfer(
        name=name, keys=keys, host_indices=support.page_indices(pages, pool.page_size), hit_policy=policy
    )


class Groups(support.TempDirTest):
    def open(self, kv_pool, mla, name, side_pool, fmt="native", factory=False):
        config = support.storage_config({**support.MODULE, "dir": self.dir, "format": fmt}, mla=mla)
        # SGLang's hybrid host pools: the KV pool anchors the group its sidecar pools join
        group = HostPoolGroup(
            [
                PoolEntry(PoolName.KV, kv_pool, None, lambda layer: layer, is_primary_index_anchor=True),
                PoolEntry(name, side_pool, None, lambda layer: layer),
            ]
        )
        if factory:
            backend = StorageBackendFactory.create_backend("dynamic", config, group)
            self.assertIsInstance(backend, HiCacheStorage)
        else:
            backend = HiCacheStorage(config, {})
        # as SGLang's hybrid controller attaches a backend: the group, then every pool of it
        backend.register_mem_pool_host(group)
        backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
        backend.register_mem_host_pool_v2(side_pool, name)
        backend.on_host_pools_registered()
        self.addCleanup(backend.close)
        return backend

    def write(self, backend, kv_pool, name, side_pool, keys, pages, policy, window):
        """Backs a run up as SGLang's hybrid controller does: the sidecar pool's entries (all pages, or the window
        that ends the run) through ``batch_set_v2``, then the KV pages through ``batch_set_v1``."""
        held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-window:]
        side_pages = pages if policy == PoolHitPolicy.ALL_PAGES else pages[-window:]
        results = backend.batch_set_v2([transfer(name, side_pool, held, side_pages, policy)])
        self.assertEqual(results[name], [True] * len(held))
        kv = support.page_indices(pages, kv_pool.page_size)
        self.assertEqual(backend.batch_set_v1(keys, kv), [True] * len(keys))
        return held, side_pages

    def query(self, backend, name, side_pool, keys, policy, window):
        held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-window:]
        return backend.batch_exists_v2(keys, [PoolTransfer(name=name, keys=held, hit_policy=policy)])

    def test_groups_round_trip_through_sglangs_factory_byte_for_byte_per_pool(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for label, kv_pool, mla, name, side_pool, policy, window in cases():
            for fmt in ("native", "sglang"):
                with self.subTest(pool=label, format=fmt):
                    backend = self.open(kv_pool, mla, name, side_pool, fmt, factory=True)
                    backend.clear()
                    keys = support.random_keys(PAGES, generator)
                    sources = list(range(1, PAGES + 1))
                    fill(kv_pool, sources, generator)
                    fill(side_pool, sources, generator)
                    held, side_pages = self.write(backend, kv_pool, name, side_pool, keys, sources, policy, window)
                    want_kv = [page(kv_pool, index) for index in sources]
                    want_side = [page(side_pool, index) for index in side_pages]
                    fill(kv_pool, sources, generator)
                    fill(side_pool, sources, generator)

                    result = self.query(backend, name, side_pool, keys, policy, window)
                    self.assertEqual(result.kv_hit_pages, PAGES)
                    self.assertEqual(result.extra_pool_hit_pages[name], PAGES)
                    self.assertEqual(result.restorable_prefix_pages[-1], PAGES)
                    targets = list(range(20, 20 + PAGES))
                    side_targets = targets if policy == PoolHitPolicy.ALL_PAGES else targets[-window:]
                    kv = support.page_indices(targets, kv_pool.page_size)
                    self.assertEqual(backend.batch_get_v1(keys, kv), [True] * PAGES)
                    got = backend.batch_get_v2([transfer(name, side_pool, held, side_targets, policy)])
                    self.assertEqual(got[name], [True] * len(held))
                    for target, want in zip(targets, want_kv):
                        self.assertTrue(support.same_bytes(page(kv_pool, target), want), f"KV page {target}")
                    for target, want in zip(side_targets, want_side):
                        self.assertTrue(support.same_bytes(page(side_pool, target), want), f"{name} page {target}")

    def test_a_missing_damaged_or_evicted_sidecar_entry_cuts_the_prefix_at_the_last_whole_group(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for label, kv_pool, mla, name, side_pool, policy, window in cases():
            with self.subTest(pool=label):
                backend = self.open(kv_pool, mla, name, side_pool, "sglang")
                backend.clear()
                keys = support.random_keys(PAGES, generator)
                sources = list(range(1, PAGES + 1))
                fill(kv_pool, sources, generator)
                fill(side_pool, sources, generator)
                # the pool's entries for every page, as if each prefix had been backed up in its turn
                every = backend.batch_set_v2([transfer(name, side_pool, keys, sources, policy)])
                self.assertEqual(every[name], [True] * PAGES)
                kv = support.page_indices(sources, kv_pool.page_size)
                self.assertEqual(backend.batch_set_v1(keys, kv), [True] * PAGES)
                # a writer killed between the KV and the sidecar: page 5's entry never written
                missing = 5
                path = self.entry_path(keys[missing], name)
                os.remove(path)
                result = self.query(backend, name, side_pool, keys[: missing + 1], policy, window)
                # a trailing pool needs the window ending the prefix; all_pages needs every page
                self.assertEqual(result.kv_hit_pages, missing, f"restorable {result.restorable_prefix_pages}")
                self.assertNotIn(missing + 1, result.restorable_prefix_pages)
                # damaged on the disk (short): read as a miss
                damaged = 2
                with open(self.entry_path(keys[damaged], name), "r+b") as file:
                    file.truncate(7)
                got = backend.batch_get_v2([transfer(name, side_pool, [keys[damaged]], [30], policy)])
                self.assertEqual(got[name], [False])
                # evicted between the query and the read: the read says so
                self.assertEqual(self.query(backend, name, side_pool, keys[:2], policy, 1).kv_hit_pages, 2)
                os.remove(self.entry_path(keys[1], name))
                got = backend.batch_get_v2([transfer(name, side_pool, [keys[1]], [31], policy)])
                self.assertEqual(got[name], [False])

    def entry_path(self, key, name):
        found = [entry for entry in os.listdir(self.dir) if entry.startswith(f"{key}.{name}_")]
        self.assertEqual(len(found), 1, f"{key}.{name}: {found}")
        return os.path.join(self.dir, found[0])

    def test_ranks_holding_different_windows_are_told_every_restorable_length(self):
        """A trailing state kept at pages 4 and 8 but not 6: 4 and 8 are restorable, 6 is not, so ranks can agree."""
        generator = torch.Generator().manual_seed(torch.seed())
        kv_pool, side_pool = support.mha_pool("page_first"), mamba_pool()
        backend = self.open(kv_pool, False, PoolName.MAMBA, side_pool)
        keys = support.random_keys(PAGES, generator)
        sources = list(range(1, PAGES + 1))
        fill(kv_pool, sources, generator)
        fill(side_pool, sources, generator)
        self.assertEqual(backend.batch_set_v1(keys, support.page_indices(sources, kv_pool.page_size)), [True] * PAGES)
        for end in (4, 8):
            stored = backend.batch_set_v2(
                [transfer(PoolName.MAMBA, side_pool, [keys[end - 1]], [end], PoolHitPolicy.TRAILING_PAGES)]
            )
            self.assertEqual(stored[PoolName.MAMBA], [True])
        result = self.query(backend, PoolName.MAMBA, side_pool, keys, PoolHitPolicy.TRAILING_PAGES, 1)
        self.assertEqual(result.restorable_prefix_pages, [4, 8])
        self.assertEqual(result.kv_hit_pages, 8)


class Ranks(support.TempDirTest):
    def test_tp_ranks_holding_different_states_answer_lengths_that_intersect_to_one_all_restore(self):
        """Two TP ranks of an MLA model share the latent but each keeps its own states: rank 0 at pages 4 and 8,
        rank 1 at 4 and 6. Their longest are 8 and 6, and the least of those (6) is one rank 0 cannot restore; the
        lengths they answer intersect to 4, which both restore byte for byte."""
        generator = torch.Generator().manual_seed(torch.seed())
        keys = support.random_keys(PAGES, generator)
        sources = list(range(1, PAGES + 1))
        kv_pool = support.mla_pool("page_first")
        fill(kv_pool, sources, generator)
        ranks = []
        for rank, ends in ((0, (4, 8)), (1, (4, 6))):
            states = mamba_pool()
            fill(states, sources, generator)
            # written in place: rank 1 reads the latent rank 0 wrote the moment it is stored (batches of small pages
            # are otherwise written behind, found by other processes once written)
            extra = {**support.MODULE, "dir": self.dir, "write_behind": 0}
            config = support.storage_config(extra, mla=True, tp_rank=rank, tp_size=2)
            backend = HiCacheStorage(config, {})
            backend.register_mem_pool_host(kv_pool)
            backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
            self.addCleanup(backend.close)
            # the latent once (rank 0 writes it for both), each rank's own states
            kv = support.page_indices(sources, kv_pool.page_size)
            self.assertEqual(backend.batch_set_v1(keys, kv), [True] * PAGES)
            for end in ends:
                stored = backend.batch_set_v2(
                    [transfer(PoolName.MAMBA, states, [keys[end - 1]], [end], PoolHitPolicy.TRAILING_PAGES)]
                )
                self.assertEqual(stored[PoolName.MAMBA], [True])
            ranks.append((backend, states, ends))
        answers = []
        for backend, _, ends in ranks:
            query = [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            result = backend.batch_exists_v2(keys, query)
            self.assertEqual(result.restorable_prefix_pages, list(ends))
            answers.append(set(result.restorable_prefix_pages))
        self.assertEqual(min(max(answer) for answer in answers), 6)
        agreed = max(set.intersection(*answers))
        self.assertEqual(agreed, 4)
        for backend, states, _ in ranks:
            want = page(states, agreed)
            got = backend.batch_get_v2(
                [transfer(PoolName.MAMBA, states, [keys[agreed - 1]], [30], PoolHitPolicy.TRAILING_PAGES)]
            )
            self.assertEqual(got[PoolName.MAMBA], [True])
            self.assertTrue(support.same_bytes(page(states, 30), want))


class Refused(support.TempDirTest):
    def test_a_scheme_without_sidecar_pools_refuses_the_pool_by_name(self):
        pool = support.mha_pool("page_unified", layers=4, heads=4, head_dim=64, page_size=16, head_group_num=4)
        extra = {**support.MODULE, "dir": self.dir, "key_scheme": "unified", "head_group": 1, "layer_partition": 1}
        backend = HiCacheStorage(support.storage_config(extra), {})
        backend.register_mem_pool_host(pool)
        self.addCleanup(backend.close)
        with self.assertRaisesRegex(ValueError, "key_scheme"):
            backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)

    def test_an_unserved_hit_policy_or_pool_is_a_miss(self):
        generator = torch.Generator().manual_seed(torch.seed())
        kv_pool, side_pool = support.mha_pool("page_first"), mamba_pool()
        backend = HiCacheStorage(support.storage_config({**support.MODULE, "dir": self.dir}), {})
        backend.register_mem_pool_host(kv_pool)
        backend.register_mem_host_pool_v2(side_pool, PoolName.MAMBA)
        self.addCleanup(backend.close)
        keys = support.random_keys(2, generator)
        fill(kv_pool, [1, 2], generator)
        fill(side_pool, [1, 2], generator)
        self.assertEqual(backend.batch_set_v1(keys, support.page_indices([1, 2], kv_pool.page_size)), [True, True])
        mamba = transfer(PoolName.MAMBA, side_pool, keys, [1, 2], PoolHitPolicy.ALL_PAGES)
        self.assertEqual(backend.batch_set_v2([mamba])[PoolName.MAMBA], [True, True])
        blocks = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        self.assertEqual(backend.batch_exists_v2(keys, [blocks]).kv_hit_pages, 0)
        unknown = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
        self.assertEqual(backend.batch_exists_v2(keys, [unknown]).kv_hit_pages, 0)
        swa = transfer(PoolName.SWA, side_pool, keys, [3, 4], PoolHitPolicy.ALL_PAGES)
        self.assertEqual(backend.batch_get_v2([swa]), {PoolName.SWA: [False, False]})
        # the same query with the pool's own policy finds both groups
        served = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
        self.assertEqual(backend.batch_exists_v2(keys, [served]).kv_hit_pages, 2)


class SharedWithHiCacheFile(support.TempDirTest):
    """SGLang's ``HiCacheFile`` v2 and hicache's ``sglang`` format read one directory of page groups."""

    def both(self, kv_pool, mla, name, side_pool):
        config = {"file_storage_path": self.dir, "enable_metadata_cache": False}
        sglang = HiCacheFile(support.storage_config(config, mla=mla))
        sglang.register_mem_pool_host(kv_pool)
        sglang.register_mem_host_pool_v2(side_pool, name)
        ours = HiCacheStorage(
            support.storage_config({**support.MODULE, "dir": self.dir, "format": "sglang"}, mla=mla), {}
        )
        ours.register_mem_pool_host(kv_pool)
        ours.register_mem_host_pool_v2(side_pool, name)
        self.addCleanup(ours.close)
        return sglang, ours

    def test_each_reads_the_groups_the_other_wrote(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for label, kv_pool, mla, name, side_pool, policy, window in cases():
            for writer in ("sglang", "hicache"):
                with self.subTest(pool=label, writer=writer):
                    sglang, ours = self.both(kv_pool, mla, name, side_pool)
                    ours.clear()
                    keys = support.random_keys(PAGES, generator)
                    sources = list(range(1, PAGES + 1))
                    fill(kv_pool, sources, generator)
                    fill(side_pool, sources, generator)
                    want_kv = [page(kv_pool, index) for index in sources]
                    want_side = [page(side_pool, index) for index in sources]
                    side = transfer(name, side_pool, keys, sources, policy)
                    if writer == "sglang":
                        # as SGLang's controller backs a group up to a file backend: sidecars (v2), then KV pages
                        self.assertEqual(sglang.batch_set_v2([side])[name], [True] * PAGES)
                        self.assertTrue(sglang.batch_set(keys, [page(kv_pool, index) for index in sources]))
                        reader = ours
                    else:
                        self.assertEqual(ours.batch_set_v2([side])[name], [True] * PAGES)
                        kv = support.page_indices(sources, kv_pool.page_size)
                        self.assertEqual(ours.batch_set_v1(keys, kv), [True] * PAGES)
                        reader = sglang
                    fill(kv_pool, sources, generator)
                    fill(side_pool, sources, generator)
                    held = keys if policy == PoolHitPolicy.ALL_PAGES else keys[-window:]
                    result = reader.batch_exists_v2(keys, [PoolTransfer(name=name, keys=held, hit_policy=policy)])
                    self.assertEqual((result.kv_hit_pages, result.restorable_prefix_pages[-1]), (PAGES, PAGES))
                    targets = list(range(20, 20 + PAGES))
                    got = reader.batch_get_v2([transfer(name, side_pool, keys, targets, policy)])
                    self.assertEqual(got[name], [True] * PAGES)
                    if writer == "sglang":
                        kv = support.page_indices(targets, kv_pool.page_size)
                        self.assertEqual(ours.batch_get_v1(keys, kv), [True] * PAGES)
                    else:
                        pages = sglang.batch_get(keys, [kv_pool.get_dummy_flat_data_page() for _ in keys])
                        for target, data in zip(targets, pages):
                            self.assertIsNotNone(data)
                            kv_pool.set_from_flat_data_page(target * kv_pool.page_size, data)
                    for target, want in zip(targets, want_kv):
                        self.assertTrue(support.same_bytes(page(kv_pool, target), want), f"KV page {target}")
                    for target, want in zip(targets, want_side):
                        self.assertTrue(support.same_bytes(page(side_pool, target), want), f"{name} page {target}")


if __name__ == "__main__":
    unittest.main()
