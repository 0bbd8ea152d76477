"""Bad configurations raise at construction or registration, naming the key; a Rust panic arrives as RuntimeError."""

import os
import unittest

import support
import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache import _native
from hicache.sglang import HiCacheStorage


class Errors(support.TempDirTest):
    def construct(self, **extra):
        if extra.get("backend", "file") == "file":
            extra.setdefault("dir", self.dir)
        return HiCacheStorage(support.storage_config({**support.MODULE, **extra}), {})

    def test_unknown_backend_names_the_key_and_the_choices(self):
        with self.assertRaisesRegex(ValueError, r"key `backend`: \"s3\" is not .*3fs, file, memory, mooncake"):
            self.construct(backend="s3")

    def test_every_tier_of_the_table_is_taken_and_reads_its_own_keys(self):
        self.assertEqual(sorted(_native.BACKENDS), ["3fs", "file", "memory", "mooncake"])
        # SGLang's name for 3FS; its keys are read by the 3FS tier, strictly
        with self.assertRaisesRegex(ValueError, "key `numjobs`"):
            self.construct(backend="hf3fs", file_path_prefix=os.path.join(self.dir, "kv"), numjobs=0)
        with self.assertRaisesRegex(ValueError, "key `\"dir\"`: unknown key"):
            self.construct(backend="3fs", file_path_prefix=os.path.join(self.dir, "kv"), dir=self.dir)
        self.assertEqual(_native.Settings('{"backend": "hf3fs", "numjobs": 2, "file_path_prefix": "/x"}').backend, "3fs")

    def test_unknown_key_is_named(self):
        with self.assertRaisesRegex(ValueError, "key `capacty`: unknown key"):
            self.construct(capacty="10gb")
        with self.assertRaisesRegex(ValueError, "key `format`"):
            self.construct(format="parquet")

    def test_wrong_types_name_the_key(self):
        with self.assertRaisesRegex(TypeError, "key `io_threads`: invalid type"):
            self.construct(io_threads="four")
        with self.assertRaisesRegex(TypeError, "key `capacity`"):
            self.construct(capacity=[1])
        with self.assertRaisesRegex(TypeError, "key `direct_io`"):
            self.construct(direct_io="yes")
        with self.assertRaisesRegex(ValueError, "key `capacity`: .*unknown unit"):
            self.construct(capacity="10 parsecs")
        with self.assertRaisesRegex(TypeError, r"key `pool.head_num`"):
            self.construct(pool={"head_num": "eight"})

    def test_a_directory_that_cannot_be_used_is_named(self):
        blocker = os.path.join(self.dir, "a-file")
        open(blocker, "w").close()
        with self.assertRaisesRegex(ValueError, "key `dir`: .*cannot be made"):
            self.construct(dir=os.path.join(blocker, "pages"))
        with self.assertRaisesRegex(ValueError, "key `dir`"):
            self.construct(dir="/proc/hicache-pages")

    def test_a_missing_directory_is_made_as_sglang_makes_it(self):
        target = os.path.join(self.dir, "new", "pages")
        self.construct(dir=target)
        self.assertTrue(os.path.isdir(target))

    def test_a_read_only_tier_makes_and_writes_nothing(self):
        target = os.path.join(self.dir, "absent")
        with self.assertRaisesRegex(ValueError, "key `dir`: .*`read_only` makes nothing"):
            self.construct(dir=target, read_only=True)
        self.assertFalse(os.path.exists(target))
        blocker = os.path.join(self.dir, "a-file")
        open(blocker, "w").close()
        with self.assertRaisesRegex(ValueError, "key `dir`: .*is not a directory"):
            self.construct(dir=blocker, read_only=True)
        os.mkdir(target)
        self.construct(dir=target, read_only=True)
        self.assertEqual(os.listdir(target), [], "a read-only tier wrote into its directory")

    def test_a_pool_other_than_the_config_says_is_refused_at_registration(self):
        backend = self.construct(pool={"head_num": 4, "layout": "page_first"})
        with self.assertRaisesRegex(ValueError, "key `pool.head_num`: the host pool has 2, the config says 4"):
            backend.register_mem_pool_host(support.mha_pool("page_first"))
        backend = self.construct(pool={"layout": "page_first"})
        with self.assertRaisesRegex(ValueError, "key `pool.layout`: the host pool has layer_first"):
            backend.register_mem_pool_host(support.mha_pool("layer_first"))
        backend = self.construct(pool={"dtype": "float16"})
        with self.assertRaisesRegex(ValueError, "key `pool.dtype`"):
            backend.register_mem_pool_host(support.mha_pool("page_first"))
        backend = self.construct(pool={"page_size": 16, "dtype": "torch.bfloat16", "head_dim": 64})
        backend.register_mem_pool_host(support.mha_pool("page_first"))
        backend.close()

    def test_mla_config_over_an_mha_pool_is_refused(self):
        backend = HiCacheStorage(support.storage_config({**support.MODULE, "dir": self.dir}, mla=True), {})
        with self.assertRaisesRegex(ValueError, "is_mla_model"):
            backend.register_mem_pool_host(support.mha_pool("page_first"))

    def test_sglang_factory_passes_the_error_on(self):
        config = support.storage_config({**support.MODULE, "backend": "nowhere"})
        with self.assertRaisesRegex(ValueError, "key `backend`"):
            StorageBackendFactory.create_backend("dynamic", config, support.mha_pool("page_first"))

    def test_a_rust_panic_arrives_as_runtime_error(self):
        with self.assertRaisesRegex(RuntimeError, "Rust panic, caught.*on purpose"):
            _native.panic_is_caught()
        # and the module still works afterwards
        self.assertEqual(len(_native.page_keys([1], 1)), 1)

    def test_a_closed_backend_answers_false(self):
        backend = self.construct(backend="memory")
        backend.register_mem_pool_host(support.mha_pool("page_first"))
        backend.close()
        keys = support.random_keys(1, torch.Generator().manual_seed(1))
        with self.assertLogs("hicache.sglang", "ERROR"):
            self.assertEqual(backend.batch_get_v1(keys, support.page_indices([1], 16)), [False])


if __name__ == "__main__":
    unittest.main()
