"""hicache as SGLang's HiCache storage (L3) backend.

SGLang (0.5.3 and later) loads it with::

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "hicache", "module_path": "hicache.sglang",
          "class_name": "HiCacheStorage", "interface_v1": 1, "backend": "file", "dir": "/data/hicache"}'

SGLang constructs the class with its ``HiCacheStorageConfig`` (rank, model, MLA or not, and the extra config above),
then registers its host pool. The extra config's own keys are checked at construction (a bad one raises, naming
the key); the tier is opened at registration, when the pool's geometry and layout are known, and the pool's buffer
is registered with it once. Pages then move straight between that buffer and the tier (``batch_get_v1`` /
``batch_set_v1``, what ``"interface_v1": 1`` selects), in Rust with the GIL released. The copy path SGLang uses
without ``interface_v1`` (``get``/``set``/``batch_get``/``batch_set`` with tensors) works too.

Keys of the extra config: ``backend`` (a tier of ``hicache.BACKENDS``: ``file``, the default; ``memory``;
``mooncake``; ``3fs``, also named ``hf3fs``), then the tier's own keys, read by it: for the file tier ``dir``,
``format`` (``native``, the default, or ``sglang``: SGLang's own ``HiCacheFile`` names and bytes, so both read one
directory), ``capacity`` (bytes or e.g. ``"200gb"``), ``io_threads``, ``direct_io``; for Mooncake SGLang's Mooncake
keys (``master_server_address``, ...); for 3FS SGLang's 3FS keys (``file_path_prefix``, ...); ``pool`` (what the host pool must be: ``page_size``, ``layout``, ``dtype``,
``layer_num``, ``head_num``, ``head_dim``, ``kv_lora_rank``, ``qk_rope_head_dim``).

Storage calls never raise into SGLang's storage threads: a failed batch is logged and answered with ``False`` pages
(a miss for a prefetch, a failed backup for a write).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _SglangStorage

from hicache import _native

logger = logging.getLogger(__name__)

__all__ = ["HiCacheStorage"]


class HiCacheStorage(_SglangStorage):
    """SGLang's ``HiCacheStorage`` over a hicache storage tier."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        self._storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        for name in ("attn_cp_size", "dcp_size"):
            if getattr(storage_config, name, 1) not in (None, 1):
                raise ValueError(
                    f"hicache: storage config {name}={getattr(storage_config, name)}: context-parallel KV shards "
                    "are not served yet"
                )
        self._settings = _native.Settings(json.dumps(extra, default=_not_json))
        is_mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        if writer is None:  # SGLang releases before the property: MLA ranks share one writer, rank 0
            writer = not is_mla or storage_config.tp_rank == 0
        self._rank = {
            "model": storage_config.model_name or "",
            "tp_rank": storage_config.tp_rank,
            "tp_size": storage_config.tp_size,
            "pp_rank": storage_config.pp_rank,
            "pp_size": storage_config.pp_size,
            "is_mla": is_mla,
            "writer": bool(writer),
        }
        self._backend = None
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics_lock = threading.Lock()
        self._reset_metrics()

    # --- registration -------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Opens the tier for this rank over the host pool and registers the pool's buffer with it."""
        super().register_mem_pool_host(mem_pool_host)
        description, buffer = _describe_pool(mem_pool_host)
        backend = self._settings.open(json.dumps(self._rank), json.dumps(description), buffer)
        if self._backend is not None:
            self._backend.close()
        self._backend = backend
        logger.info(
            "hicache: %s tier open for %s (rank %d/%d, %s, %d bytes per page)",
            backend.name,
            self._rank["model"] or "an unnamed model",
            self._rank["tp_rank"],
            self._rank["tp_size"],
            description["layout"],
            backend.page_bytes,
        )

    # --- zero-copy path (interface_v1) -----------------------------------------------------------------------------

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        try:
            indices = _int64_indices(host_indices)
            started = time.perf_counter()
            results = self._open().batch_get(keys, indices.data_ptr(), indices.numel())
            if self._metrics:
                self._record("prefetch", _leading(results), started)
            return results
        except Exception:
            logger.exception("hicache: reading %d pages failed", len(keys))
            return [False] * len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        try:
            indices = _int64_indices(host_indices)
            started = time.perf_counter()
            results = self._open().batch_set(keys, indices.data_ptr(), indices.numel())
            if self._metrics:
                self._record("backup", sum(results), started)
            return results
        except Exception:
            logger.exception("hicache: writing %d pages failed", len(keys))
            return [False] * len(keys)

    # --- queries ---------------------------------------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if not keys:
            return 0
        try:
            return self._open().batch_exists(keys)
        except Exception:
            logger.exception("hicache: querying %d pages failed", len(keys))
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- copy path (without interface_v1) ----------------------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        if not keys:
            return []
        try:
            backend = self._open()
            targets = target_locations
            if targets is None:
                targets = [torch.empty(backend.page_bytes, dtype=torch.uint8) for _ in keys]
            flats = [_flat_bytes(target, "target_locations") for target in targets]
            started = time.perf_counter()
            results = backend.get_into(keys, [flat.data_ptr() for flat in flats], [flat.numel() for flat in flats])
            if self._metrics:
                self._record("prefetch", _leading(results), started)
            return [target if ok else None for target, ok in zip(targets, results)]
        except Exception:
            logger.exception("hicache: reading %d pages failed", len(keys))
            return [None] * len(keys)

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if not keys:
            return True
        try:
            if values is None or len(values) != len(keys):
                raise ValueError(f"hicache: {len(keys)} keys need as many values")
            flats = [_flat_bytes(value, "values") for value in values]
            started = time.perf_counter()
            results = self._open().set_from(keys, [flat.data_ptr() for flat in flats], [flat.numel() for flat in flats])
            if self._metrics:
                self._record("backup", sum(results), started)
            return all(results)
        except Exception:
            logger.exception("hicache: writing %d pages failed", len(keys))
            return False

    # --- housekeeping ----------------------------------------------------------------------------------------------

    def clear(self) -> bool:
        """Removes this rank's pages (its namespace only: other models and ranks sharing the store keep theirs)."""
        try:
            removed = self._open().clear()
            logger.info("hicache: cleared %d pages", removed)
            return True
        except Exception:
            logger.exception("hicache: clearing the store failed")
            return False

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (when storage metrics are on), else None."""
        if not self._metrics:
            return None
        metrics_class = _storage_metrics_class()
        if metrics_class is None:
            return None
        with self._metrics_lock:
            metrics = metrics_class()
            for name, values in self._samples.items():
                getattr(metrics, name).extend(values)
            self._reset_metrics()
        return metrics

    def describe_l3_object_layout(self, *, sidecar_pool_specs=(), swa_trailing_pages=None, page_size=None) -> dict:
        """The key layout a router outside the engine (SGLang's ``/get_hicache_l3_cache_layout``) needs to find this
        stage's pages in the store, in the shape of SGLang's ``MooncakeStore.describe_l3_object_layout``: every TP
        rank's objects (a page is stored when all are), each stage its own (``hicache.merge_l3_layouts`` joins
        them). Disabled, with the reason, before a host pool is registered, on a tier whose objects are not found
        by name outside hicache (only Mooncake's are), and for hybrid models' sidecar pools, which hicache does not
        store."""
        from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout

        backend = self._settings.backend
        if sidecar_pool_specs or swa_trailing_pages is not None:
            return disabled_l3_layout(
                "hicache stores no sidecar pools of hybrid models", backend=backend, page_size=page_size
            )
        if self._backend is None:
            return disabled_l3_layout("no host pool is registered yet", backend=backend, page_size=page_size)
        layout = json.loads(self._backend.l3_layout)
        if page_size is not None and page_size != layout.get("page_size"):
            return disabled_l3_layout(
                f"the engine's page size {page_size} is not the host pool's {layout.get('page_size')}",
                backend=backend,
                page_size=page_size,
            )
        return layout

    def hicache_stats(self) -> dict:
        """The tier's counters since it was opened (pages and bytes read and written, hits, misses, failures)."""
        return {} if self._backend is None else self._backend.stats()

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()

    # --- helpers ---------------------------------------------------------------------------------------------------

    def _open(self):
        if self._backend is None:
            raise RuntimeError("hicache: no host pool registered yet (register_mem_pool_host)")
        return self._backend

    def _reset_metrics(self) -> None:
        self._samples = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    def _record(self, direction: str, pages: int, started: float) -> None:
        seconds = max(time.perf_counter() - started, 1e-9)
        gigabytes = pages * self._backend.page_bytes / 1e9
        with self._metrics_lock:
            self._samples[f"{direction}_pgs"].append(pages)
            self._samples[f"{direction}_bandwidth"].append(gigabytes / seconds)


def _describe_pool(pool):
    """What the tier needs to know of SGLang's host pool, and its buffer tensor."""
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"hicache: host pool {type(pool).__name__} has no KV buffer tensor (an allocator-only pool)")
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"hicache: host pool {type(pool).__name__}: its KV buffer must be one contiguous CPU tensor")
    if getattr(pool, "dcp_size", 1) != 1:
        raise ValueError(f"hicache: host pool dcp_size={pool.dcp_size}: context-parallel shards are not served yet")
    description = {
        "layout": pool.layout,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "itemsize": pool.dtype.itemsize,
        "layer_num": pool.layer_num,
        "page_size": pool.page_size,
        "size": pool.size,
        "address": buffer.data_ptr(),
        "nbytes": buffer.numel() * buffer.element_size(),
    }
    if pool.layout == "page_unified":
        description["head_group_num"] = getattr(pool, "head_group_num", 1)
    if getattr(pool, "start_layer", None) is not None:
        description["start_layer"] = pool.start_layer
    if hasattr(pool, "kv_lora_rank"):
        description.update(
            kind="mla",
            kv_lora_rank=pool.kv_lora_rank,
            qk_rope_head_dim=pool.qk_rope_head_dim,
            kv_cache_dim=pool.kv_cache_dim,
        )
    elif hasattr(pool, "head_num"):
        description.update(
            kind="mha",
            head_num=pool.head_num,
            head_dim=pool.head_dim,
            v_head_dim=getattr(pool, "v_head_dim", pool.head_dim),
        )
    else:
        raise ValueError(f"hicache: host pool {type(pool).__name__} holds neither MHA nor MLA KV")
    return description, buffer


def _int64_indices(host_indices: torch.Tensor) -> torch.Tensor:
    if host_indices.dtype == torch.int64 and host_indices.device.type == "cpu" and host_indices.is_contiguous():
        return host_indices
    return host_indices.to(device="cpu", dtype=torch.int64).contiguous()


def _flat_bytes(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"hicache: {what}: each must be a contiguous CPU tensor")
    return tensor.view(-1).view(torch.uint8)


def _leading(results: List[bool]) -> int:
    return next((at for at, ok in enumerate(results) if not ok), len(results))


def _not_json(value):
    raise TypeError(f"hicache extra_config: {value!r} ({type(value).__name__}) is not a JSON value")


def _storage_metrics_class():
    for module in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
        try:
            return getattr(__import__(module, fromlist=["StorageMetrics"]), "StorageMetrics")
        except (ImportError, AttributeError):
            continue
    return None
