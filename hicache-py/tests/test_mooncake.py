"""The Mooncake tier through the package: a real `mooncake_master` on loopback, SGLang's host pools, SGLang's keys.

Needs what `cargo xtask mooncake` unpacks under `target/mooncake/` (`cargo xtask ci` passes the paths in
`HICACHE_MOONCAKE_MASTER_BIN` and `MOONCAKE_STORE_LIBRARY`). Without them the tests are skipped, visibly; under
`CI=true` they fail instead.
"""

import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest

import support
import torch

import hicache
from hicache.sglang import HiCacheStorage
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
UNPACKED = os.path.join(ROOT, "target", "mooncake")
MASTER = os.environ.get("HICACHE_MOONCAKE_MASTER_BIN") or os.path.join(UNPACKED, "official/lib/mooncake/mooncake_master")
LIBRARY = os.environ.get("MOONCAKE_STORE_LIBRARY") or os.path.join(UNPACKED, "store/lib/mooncake/libmooncake_store.so")
SHIM = os.path.join(UNPACKED, "no-device-cuda-shim", "libcuda.so.1")
# Mooncake's official Python client (`mooncake.store`), which SGLang's own MooncakeStore imports
# whether the no-device stand-in of libcuda.so.1 is needed (no CUDA driver here)
NEEDS_SHIM = False
OFFICIAL = os.environ.get("HICACHE_MOONCAKE_PYTHONPATH") or os.path.join(UNPACKED, "official", "lib")


def setUpModule():
    missing = [path for path in (MASTER, LIBRARY) if not os.path.isfile(path)]
    if missing:
        message = f"Mooncake is not unpacked ({', '.join(missing)}): run `cargo xtask mooncake`"
        if os.environ.get("CI") == "true":
            raise RuntimeError(message)
        raise unittest.SkipTest(message)
    global NEEDS_SHIM
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        # no CUDA driver here: the store library's need for libcuda.so.1 is met by the no-device stand-in
        ctypes.CDLL(SHIM, mode=ctypes.RTLD_GLOBAL)
        NEEDS_SHIM = True


def digest(tensor):
    """The SHA-256 of a tensor's bytes, as `sglang_mooncake_groups.py` prints it."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def die_with_parent():
    # the master is killed when this process ends, even without tearDown
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Master:
    """`mooncake_master` on loopback ports, stopped by its PID."""

    def __init__(self):
        for _ in range(5):
            self.port = free_port()
            self.process = subprocess.Popen(
                [MASTER, f"--rpc_port={self.port}", f"--metrics_port={free_port()}", "--rpc_address=127.0.0.1",
                 "--metrics_host=127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.02)
            self.stop()
        raise RuntimeError("mooncake_master did not come up")

    def stop(self):
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


class MooncakeTier(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.master = Master()

    @classmethod
    def tearDownClass(cls):
        cls.master.stop()

    def extra(self, **more):
        return {
            **support.MODULE,
            "backend": "mooncake",
            "master_server_address": f"127.0.0.1:{self.master.port}",
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "global_segment_size": "256mb",
            "local_buffer_size": "16mb",
            "library": LIBRARY,
            **more,
        }

    def test_pages_round_trip_under_each_key_scheme(self):
        generator = torch.Generator().manual_seed(torch.seed())
        for scheme in ({"key_scheme": "native"}, {"key_scheme": "sglang"}, {"key_scheme": "sglang", "sglang_release": "0.5.2"}):
            for name, pool, mla in (("mha", support.mha_pool("page_first"), False), ("mla", support.mla_pool("page_first"), True)):
                with self.subTest(scheme=scheme, pool=name):
                    backend = HiCacheStorage(support.storage_config(self.extra(**scheme), mla=mla), {})
                    backend.register_mem_pool_host(pool)
                    support.randomize(pool, int(torch.randint(0, 2**31, (1,), generator=generator)))
                    keys = support.random_keys(5, generator)
                    sources, targets = [1, 3, 5, 7, 9], [20, 21, 22, 23, 24, 25]
                    expected = [pool.get_data_page(page * pool.page_size).clone() for page in sources]
                    self.assertEqual(backend.batch_set_v1(keys, support.page_indices(sources, pool.page_size)), [True] * 5)
                    missing = support.random_keys(1, generator)
                    asked = keys[:2] + missing + keys[2:]
                    self.assertEqual(backend.batch_exists(asked), 2)
                    pool.kv_buffer.zero_()
                    got = backend.batch_get_v1(asked, support.page_indices(targets, pool.page_size))
                    self.assertEqual(got, [True, True, False, True, True, True])
                    for page, want in zip(targets[:2] + targets[3:], expected):
                        self.assertTrue(support.same_bytes(pool.get_data_page(page * pool.page_size), want))
                    self.assertEqual(backend.hicache_stats()["staging_bytes"], 0)  # page-first: straight from the pool
                    backend.clear()
                    self.assertEqual(backend.batch_exists(keys), 0)
                    backend.close()

    def official(self, script, spec):
        """Runs `script` (beside this file) with JSON `spec` in a process of its own, where Mooncake's official client
        can load (it and the store library hicache loads register the same flags and cannot share one process); what
        it printed last, as JSON."""
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        if NEEDS_SHIM:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([os.path.dirname(SHIM), os.environ.get("LD_LIBRARY_PATH", "")])
        done = subprocess.run(
            [sys.executable, os.path.join(here, script), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        self.assertEqual(done.returncode, 0, done.stderr[-4000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def test_the_layout_for_routers_is_the_one_sglangs_own_mooncake_store_gives(self):
        # SGLang's own MooncakeStore, on the same master through Mooncake's official client (in a process of its
        # own: that client and the store library hicache loads cannot share one), describes its MLA stages for
        # routers; hicache storing under SGLang's keys describes the same objects and joins the stages as SGLang does
        spec = {"master": f"127.0.0.1:{self.master.port}", "extra_backend_tag": "blue", "official": OFFICIAL}
        theirs = self.official("sglang_mooncake_layout.py", spec)
        extra = self.extra(key_scheme="sglang", extra_backend_tag="blue")
        ours = []
        for stage in range(2):
            for tp_rank in range(2):
                pool = support.mla_pool("page_first")
                backend = HiCacheStorage(support.storage_config(extra, mla=True, tp_rank=tp_rank, tp_size=2, pp=(stage, 2)), {})
                backend.register_mem_pool_host(pool)
                ours.append(
                    backend.describe_l3_object_layout(sidecar_pool_specs=(), swa_trailing_pages=None, page_size=pool.page_size)
                )
                backend.close()
                self.assertTrue(ours[-1]["enabled"])
                self.assertEqual(ours[-1], theirs["mla"][stage * 2 + tp_rank], f"stage {stage}, rank {tp_rank}")
        merged = hicache.merge_l3_layouts(ours)
        self.assertEqual(merged, theirs["merged"])
        self.assertEqual([pool["suffixes"] for pool in merged["hicache_object_layout"]["pools"]], [["_0_k"], ["_1_k"]])
        # MHA: SGLang serves no layout (one scheduler cannot list the other ranks' keys); hicache lists every rank's,
        # as SGLang's own key builder names them on each rank
        self.assertEqual([rank["enabled"] for rank in theirs["mha"]], [False, False])
        for tp_rank in range(2):
            backend = HiCacheStorage(support.storage_config(extra, tp_rank=tp_rank, tp_size=2), {})
            backend.register_mem_pool_host(support.mha_pool("page_first"))
            layout = backend.describe_l3_object_layout(page_size=16)
            backend.close()
            self.assertEqual(
                layout["hicache_object_layout"]["pools"][0]["suffixes"], theirs["mha"][0]["keys"] + theirs["mha"][1]["keys"]
            )

    def test_a_router_finds_a_hybrid_models_restorable_prefixes_from_the_layout_alone(self):
        """An MLA model whose two TP ranks share the latent but keep their own Mamba states (rank 0 at pages 4 and
        8, rank 1 at 4 and 6): the layout lists the latent's objects and both ranks' state objects, a trailing page
        each, and a router that reads it, asking the master with Mooncake's official client, finds the one length
        every rank restores (4), the intersection of what each rank's ``batch_exists_v2`` answers."""
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from test_hybrid import PAGES, fill, mamba_pool, transfer

        generator = torch.Generator().manual_seed(torch.seed())
        keys = support.random_keys(PAGES, generator)
        sources = list(range(1, PAGES + 1))
        kv_pool = support.mla_pool("page_first")
        fill(kv_pool, sources, generator)
        answers, layouts = [], []
        for rank, ends in ((0, (4, 8)), (1, (4, 6))):
            states = mamba_pool()
            fill(states, sources, generator)
            backend = HiCacheStorage(support.storage_config(self.extra(), mla=True, tp_rank=rank, tp_size=2), {})
            self.addCleanup(backend.close)
            backend.register_mem_pool_host(kv_pool)
            backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
            kv = support.page_indices(sources, kv_pool.page_size)
            self.assertEqual(backend.batch_set_v1(keys, kv), [True] * PAGES)
            for end in ends:
                state = transfer(PoolName.MAMBA, states, [keys[end - 1]], [end], PoolHitPolicy.TRAILING_PAGES)
                self.assertEqual(backend.batch_set_v2([state])[PoolName.MAMBA], [True])
            query = [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            answers.append(set(backend.batch_exists_v2(keys, query).restorable_prefix_pages))
            layout = backend.describe_l3_object_layout(
                sidecar_pool_specs=(), swa_trailing_pages=None, page_size=kv_pool.page_size
            )
            layouts.append(layout)
        self.assertEqual(answers, [{4, 8}, {4, 6}])
        self.assertEqual(layouts[0], layouts[1], "one stage, one layout, whichever rank serves it")
        pools = layouts[0]["hicache_object_layout"]["pools"]
        self.assertEqual([(pool["pool"], pool["hit_policy"], pool.get("trailing_pages")) for pool in pools],
                         [("kv", "all_pages", None), ("mamba", "trailing_pages", 1)])
        self.assertEqual(len(pools[1]["suffixes"]), 4, "each rank's state and its checksum")
        spec = {"master": f"127.0.0.1:{self.master.port}", "official": OFFICIAL, "layout": layouts[0], "hashes": keys}
        found = self.official("route_hybrid_layout.py", spec)
        self.assertEqual(found, sorted(set.intersection(*answers)))
        self.assertEqual(found, [4])

    def test_sglangs_own_mooncake_store_and_hicache_read_each_others_groups(self):
        """A hybrid model's page groups under SGLang's Mooncake keys, one case per kind (a Mamba state of two
        buffers, a sliding window of MHA with its K and V, a DSA indexer beside MLA, a draft model's KV beside MHA
        and beside MLA), on TP rank 1 of 2 (0 for MLA, whose rank 0 writes): SGLang's own MooncakeStore, through Mooncake's official client, writes groups
        that hicache finds restorable and reads byte for byte per pool, and reads those hicache writes."""
        from test_hybrid import PAGES, cases, fill, page, transfer

        generator = torch.Generator().manual_seed(torch.seed())
        tag = "groups"
        extra = self.extra(key_scheme="sglang", extra_backend_tag=tag)
        for label, kv_pool, mla, name, side_pool, policy, window in cases():
            if "layer_first" in label:
                with self.subTest(pool=label):
                    # SGLang's objects of a layer-first pool need not follow its flat pages' byte order (it packs
                    # per-layer buffers as they come): refused at registration, naming the setting, not cut wrongly
                    backend = HiCacheStorage(support.storage_config(extra, mla=mla), {})
                    self.addCleanup(backend.close)
                    backend.register_mem_pool_host(kv_pool)
                    with self.assertRaisesRegex(ValueError, "key_scheme"):
                        backend.register_mem_host_pool_v2(side_pool, name)
                continue
            with self.subTest(pool=label):
                rank = 0 if mla else 1
                spec = {
                    "master": f"127.0.0.1:{self.master.port}",
                    "official": OFFICIAL,
                    "extra_backend_tag": tag,
                    "case": label,
                    "tp_rank": rank,
                    "tp_size": 2,
                }
                sources = list(range(1, PAGES + 1))
                held = PAGES if policy == PoolHitPolicy.ALL_PAGES else window
                backend = HiCacheStorage(support.storage_config(extra, mla=mla, tp_rank=rank, tp_size=2), {})
                self.addCleanup(backend.close)
                backend.register_mem_pool_host(kv_pool)
                backend.register_mem_host_pool_v2(side_pool, name)

                # SGLang writes, hicache reads; SGLang's client mounts no memory, so its objects stay in hicache's
                # segment after its process ends (a client's objects go with the segment it mounted)
                keys = support.random_keys(PAGES, generator)
                seed = int(torch.randint(0, 2**31, (1,), generator=generator))
                write = {**spec, "mode": "write", "seed": seed, "keys": keys, "global_segment_size": 0}
                written = self.official("sglang_mooncake_groups.py", write)
                self.assertEqual((written["side"], written["kv"]), ([True] * held, [True] * PAGES))
                # the layout for routers: SGLang's own where it serves one (MLA), else every rank's objects
                layout = backend.describe_l3_object_layout(
                    sidecar_pool_specs=(), swa_trailing_pages=window or None, page_size=kv_pool.page_size
                )
                listed = layout["hicache_object_layout"]["pools"][1]["suffixes"]
                if mla:
                    self.assertEqual(layout, written["layout"])
                else:
                    self.assertFalse(written["layout"]["enabled"])
                    self.assertEqual(listed[rank * len(listed) // 2 :][: len(listed) // 2], written["suffixes"])
                bytes_of = torch.Generator().manual_seed(seed)
                fill(kv_pool, sources, bytes_of)
                fill(side_pool, sources, bytes_of)
                want_kv = [page(kv_pool, index) for index in sources]
                want_side = [page(side_pool, index) for index in sources[-held:]]
                fill(kv_pool, sources, generator)
                fill(side_pool, sources, generator)
                query = [PoolTransfer(name=name, keys=keys[-held:], hit_policy=policy)]
                result = backend.batch_exists_v2(keys, query)
                self.assertEqual((result.kv_hit_pages, result.restorable_prefix_pages[-1]), (PAGES, PAGES))
                kv = support.page_indices(sources, kv_pool.page_size)
                side = transfer(name, side_pool, keys[-held:], sources[-held:], policy)
                self.assertEqual(backend.batch_get_v2([side])[name], [True] * held)
                self.assertEqual(backend.batch_get_v1(keys, kv), [True] * PAGES)
                for index, want in zip(sources, want_kv):
                    self.assertTrue(support.same_bytes(page(kv_pool, index), want), f"KV page {index}")
                for index, want in zip(sources[-held:], want_side):
                    self.assertTrue(support.same_bytes(page(side_pool, index), want), f"{name} page {index}")

                # hicache writes, SGLang reads
                keys = support.random_keys(PAGES, generator)
                fill(kv_pool, sources, generator)
                fill(side_pool, sources, generator)
                side = transfer(name, side_pool, keys[-held:], sources[-held:], policy)
                self.assertEqual(backend.batch_set_v2([side])[name], [True] * held)
                self.assertEqual(backend.batch_set_v1(keys, kv), [True] * PAGES)
                read = self.official("sglang_mooncake_groups.py", {**spec, "mode": "read", "seed": seed, "keys": keys})
                self.assertEqual(read["restorable"][-1], PAGES)
                self.assertEqual((read["side"], read["kv"]), ([True] * held, [True] * PAGES))
                self.assertEqual(read["kv_pages"], [digest(page(kv_pool, index)) for index in sources])
                self.assertEqual(read["side_pages"], [digest(page(side_pool, index)) for index in sources[-held:]])
                backend.clear()

    def test_sidecar_pools_get_sglangs_hit_policies_in_the_layout(self):
        """As SGLang's MooncakeStore decides them: a Mamba state trails by one page, a sliding window by
        ``swa_trailing_pages`` (unknown: the layout is disabled with SGLang's reason), a spec overrides either, and
        other pools need every page."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, SidecarPoolSpec
        from test_hybrid import mamba_pool

        kv_pool = support.mha_pool("page_first")
        backend = HiCacheStorage(support.storage_config(self.extra(), tp_size=2), {})
        self.addCleanup(backend.close)
        backend.register_mem_pool_host(kv_pool)
        backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
        backend.register_mem_host_pool_v2(support.mha_pool("page_first", layers=1, heads=1, head_dim=32), PoolName.SWA)
        backend.register_mem_host_pool_v2(support.mha_pool("page_first", layers=1, heads=1, head_dim=16), PoolName.DRAFT)

        def policies(**arguments):
            layout = backend.describe_l3_object_layout(page_size=kv_pool.page_size, **arguments)
            if not layout["enabled"]:
                return layout["reason"]
            pools = layout["hicache_object_layout"]["pools"]
            # every pool lists both ranks' objects, each with its checksum
            self.assertTrue(all(len(pool["suffixes"]) in (4, 6) for pool in pools), pools)
            return {pool["pool"]: (pool["hit_policy"], pool.get("trailing_pages")) for pool in pools}

        self.assertEqual(policies(), "Unknown or non-positive trailing-page window for pool swa")
        self.assertEqual(
            policies(swa_trailing_pages=3),
            {
                "kv": ("all_pages", None),
                "mamba": ("trailing_pages", 1),
                "swa": ("trailing_pages", 3),
                "draft": ("all_pages", None),
            },
        )
        spec = SidecarPoolSpec(pool_name=PoolName.SWA, indices_from_pool=PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)
        self.assertEqual(policies(sidecar_pool_specs=[spec])["swa"], ("all_pages", None))
        spec = SidecarPoolSpec(
            pool_name=PoolName.DRAFT, indices_from_pool=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES
        )
        self.assertEqual(policies(sidecar_pool_specs=[spec], swa_trailing_pages=2)["draft"], ("trailing_pages", 1))

    def test_a_master_that_is_not_there_is_an_error_at_registration(self):
        backend = HiCacheStorage(
            support.storage_config(self.extra(master_server_address=f"127.0.0.1:{free_port()}")), {}
        )
        with self.assertRaises(OSError):
            backend.register_mem_pool_host(support.mha_pool("page_first"))

    def test_a_bad_mooncake_key_is_named_at_construction(self):
        with self.assertRaisesRegex(ValueError, "protocl"):
            HiCacheStorage(support.storage_config(self.extra(protocl="tcp")), {})


if __name__ == "__main__":
    unittest.main()
