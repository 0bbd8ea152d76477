"""Shared helpers of the package's tests: SGLang's own host pools and storage configs, built on the CPU."""

from __future__ import annotations

import os
import tempfile
import unittest
import warnings

warnings.filterwarnings("ignore", message="Only CUDA")  # SGLang's quantization modules, imported on the CPU

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MODULE = {"backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HiCacheStorage", "interface_v1": 1}


def _pointers(tensors):
    return torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.uint64)


def mha_pool(
    layout, layers=2, heads=2, head_dim=64, page_size=16, device_tokens=256, dtype=torch.bfloat16, head_group_num=1
):
    """SGLang's MHA host pool over CPU "device" tensors (per-layer K and V, as SGLang's device pool keeps them);
    `page_unified` pages cut into `head_group_num` head groups."""
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
        head_group_num=head_group_num,
    )


def mla_pool(layout, layers=2, kv_lora_rank=512, rope_dim=64, page_size=16, device_tokens=256, dtype=torch.bfloat16):
    """SGLang's MLA host pool over CPU "device" tensors."""
    width = kv_lora_rank + rope_dim
    latent = tuple(torch.zeros(device_tokens, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=latent,
        data_ptrs=_pointers(latent),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def storage_config(
    extra, mla=False, tp_rank=0, tp_size=1, model="org/model-1", page_first=True, metrics=False, pp=(0, 1)
):
    """SGLang's storage config for one rank (of pipeline stage `pp[0]` of `pp[1]`)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )


def randomize(pool, seed):
    """Fills the pool's whole buffer with random bytes."""
    generator = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


def page_indices(pages, page_size):
    """SGLang's host_indices for whole host pages `pages`, page after page."""
    return torch.cat([torch.arange(page * page_size, (page + 1) * page_size, dtype=torch.int64) for page in pages])


def random_keys(count, generator):
    return [bytes(torch.randint(0, 256, (32,), dtype=torch.uint8, generator=generator).tolist()).hex() for _ in range(count)]


class TempDirTest(unittest.TestCase):
    """A test with a fresh directory, and SGLang's directory variable out of the way."""

    def setUp(self):
        self._dir = tempfile.TemporaryDirectory(prefix="hicache-py-")
        self.dir = self._dir.name
        self._saved = os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)

    def tearDown(self):
        if self._saved is not None:
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self._saved
        self._dir.cleanup()


def same_bytes(left, right):
    """Byte equality of two tensors (random bytes make NaNs, which `torch.equal` calls unequal to themselves)."""
    return torch.equal(left.contiguous().view(torch.uint8), right.contiguous().view(torch.uint8))


def official_mooncake_extra(spec):
    """SGLang's extra config for its own MooncakeStore on the test master (the scripts run with Mooncake's official
    client): `master`, `extra_backend_tag` and, optionally, `global_segment_size` (64 MiB when not given) of the
    JSON spec a test passes them."""
    return {
        "master_server_address": spec["master"],
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": spec.get("global_segment_size", 64 << 20),
        "local_buffer_size": 16 << 20,
        "extra_backend_tag": spec["extra_backend_tag"],
    }
