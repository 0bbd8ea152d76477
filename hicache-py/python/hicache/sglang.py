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
directory), ``capacity`` (bytes or e.g. ``"200gb"``), ``io_threads``, ``direct_io``, ``read_only`` (inspection:
nothing is made or written) and the small pages' ``segment_threshold``, ``segment_bytes``, ``io_uring``,
``read_ahead``, ``write_behind``, ``preallocate``, ``write_split``; for Mooncake SGLang's Mooncake
keys (``master_server_address``, ...); for 3FS SGLang's 3FS keys (``file_path_prefix``, ...); ``pool`` (what the host pool must be: ``page_size``, ``layout``, ``dtype``,
``layer_num``, ``head_num``, ``head_dim``, ``kv_lora_rank``, ``qk_rope_head_dim``).

Hybrid models (SGLang's ``*_v2`` calls): each sidecar pool SGLang registers with ``register_mem_host_pool_v2`` (a
Mamba state, a sliding window's KV, a DSA indexer, a draft model's KV) is kept in the same tier under the KV pages'
keys, in a namespace of its own; ``batch_exists_v2`` counts a prefix only where every pool holds what its hit policy
needs, and lists every restorable length for ranks to agree on.

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
        # sidecar pools of a hybrid model: name -> (the tier's pool, SGLang's host pool)
        self._sidecars = {}
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics_lock = threading.Lock()
        self._reset_metrics()

    # --- registration -------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Opens the tier for this rank over the host pool and registers the pool's buffer with it."""
        super().register_mem_pool_host(mem_pool_host)
        description, buffer = _describe_pool(_kv_pool_of(mem_pool_host))
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

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Opens a hybrid model's sidecar pool (a Mamba state, a sliding window, an indexer, a draft model's KV) in
        the tier, in a namespace of its own under the KV pages' keys. Raises, naming the pool, where the tier does not
        keep sidecar pools (so the attach fails instead of serving KV pages without their state)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == "kv":
            return
        if self._backend is None:
            raise RuntimeError(f"hicache: sidecar pool {name!r} registered before the host pool of the KV")
        entry_bytes = _flat_page_bytes(host_pool.get_dummy_flat_data_page())
        # a Mamba state is held per TP rank even where the KV is replicated (MLA), so every rank writes its own
        writer = self._backend.writer or name == "mamba"
        objects = _sglang_entry_objects(host_pool, name, self._rank["is_mla"], entry_bytes)
        sidecar = self._settings.open_sidecar(self._backend, name, entry_bytes, writer, objects)
        old = self._sidecars.pop(name, None)
        if old is not None:
            old[0].close()
        self._sidecars[name] = (sidecar, host_pool)
        logger.info("hicache: sidecar pool %s open (%d bytes per entry)", name, entry_bytes)

    # --- hybrid models (the v2 interface) ----------------------------------------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        """The prefix of `keys` whose page groups are whole: the KV pages, and each sidecar pool's entries as its hit
        policy needs them (``all_pages``: every page; ``trailing_pages``: the window of ``len(transfer.keys)`` pages
        before the prefix's end). ``restorable_prefix_pages`` lists every restorable length, so that tensor-parallel
        ranks holding different windows agree on one all of them can restore. A failed query is a miss."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        if not keys:
            return PoolTransferResult.empty()
        try:
            pools = []
            for transfer in pool_transfers or []:
                name = _pool_name(transfer.name)
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                pools.append((self._sidecar(name)[0], _pool_name(transfer.hit_policy), window))
            kv_pages, pool_pages, lengths = self._open().query_groups(keys, pools)
        except Exception:
            logger.exception("hicache: querying %d page groups failed", len(keys))
            return PoolTransferResult.empty()
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        for transfer, pages in zip(pool_transfers or [], pool_pages):
            if pages:
                hits[transfer.name] = pages
        return PoolTransferResult(lengths[-1] if lengths else 0, hits, lengths)

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Reads each transfer's entries into its host pool: the KV pages as ``batch_get_v1`` does, a sidecar pool's
        entries straight into a page-first pool's pages, else through flat pages. True for each entry read whole
        (checked against its checksum where the tier keeps one); the slot of an entry that is not holds nothing
        usable."""
        return {transfer.name: self._transfer(transfer, read=True) for transfer in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Writes each transfer's entries from its host pool. True for each entry stored (or already stored)."""
        return {transfer.name: self._transfer(transfer, read=False) for transfer in transfers}

    def _transfer(self, transfer, read: bool) -> List[bool]:
        keys = list(transfer.keys or [])
        name = _pool_name(transfer.name)
        if not keys:
            return []
        if name == "kv":
            return (self.batch_get_v1 if read else self.batch_set_v1)(keys, transfer.host_indices)
        try:
            sidecar, host_pool = self._sidecar(name)
            page_size = getattr(host_pool, "page_size", 1) or 1
            indices = transfer.host_indices
            if indices is None or indices.numel() != len(keys) * page_size:
                got = 0 if indices is None else indices.numel()
                raise ValueError(
                    f"hicache: pool {name}: {len(keys)} keys need {len(keys) * page_size} host indices, got {got}"
                )
            segments = _entry_segments(host_pool, indices, len(keys), sidecar.entry_bytes)
            if segments is not None:
                # straight between the pool's pages and the tier
                addresses, lengths, per_entry = segments
                move = sidecar.get_into if read else sidecar.set_from
                return move(keys, addresses, lengths, per_entry)
            slots = [int(slot) for slot in indices.reshape(-1)[::page_size].tolist()]
            if read:
                like = host_pool.get_dummy_flat_data_page()
                entries = torch.empty((len(keys), like.numel()), dtype=like.dtype)
                results = sidecar.get_into(
                    keys, [entry.data_ptr() for entry in entries], [sidecar.entry_bytes] * len(keys)
                )
                for slot, entry, whole in zip(slots, entries, results):
                    if whole:
                        host_pool.set_from_flat_data_page(slot, entry)
                return results
            pages = [host_pool.get_data_page(slot, flat=True).contiguous() for slot in slots]
            return sidecar.set_from(keys, [page.data_ptr() for page in pages], [_flat_page_bytes(p) for p in pages])
        except Exception:
            doing = "reading" if read else "writing"
            logger.exception("hicache: %s %d entries of pool %s failed", doing, len(keys), name)
            return [False] * len(keys)

    def _sidecar(self, name: str):
        try:
            return self._sidecars[name]
        except KeyError:
            raise ValueError(f"hicache: pool {name!r} was not registered (register_mem_host_pool_v2)") from None

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
            for sidecar, _ in self._sidecars.values():
                removed += sidecar.clear()
            logger.info("hicache: cleared %d pages and sidecar entries", removed)
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
        them), then each registered sidecar pool of a hybrid model with its hit policy as SGLang decides it (from
        ``sidecar_pool_specs``, else a trailing page for a Mamba state and ``swa_trailing_pages`` for a sliding
        window, else every page). Disabled, with the reason, before a host pool is registered, on a tier whose
        objects are not found by name outside hicache (only Mooncake's are), and for a trailing pool whose window is
        unknown."""
        from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout

        backend = self._settings.backend
        if self._backend is None:
            return disabled_l3_layout("no host pool is registered yet", backend=backend, page_size=page_size)
        if self._sidecars:
            specs = {_pool_name(spec.pool_name): spec for spec in sidecar_pool_specs}
            trailing = {"mamba": 1, "swa": swa_trailing_pages}
            pools = []
            for name, (sidecar, _) in self._sidecars.items():
                spec = specs.get(name)
                if spec is not None:
                    policy = _pool_name(spec.hit_policy)
                else:
                    policy = "trailing_pages" if name in trailing else "all_pages"
                window = 0
                if policy == "trailing_pages":
                    source = _pool_name(spec.indices_from_pool) if spec is not None else name
                    window = trailing.get(source)
                    if window is None or window <= 0:
                        return disabled_l3_layout(
                            f"Unknown or non-positive trailing-page window for pool {name}",
                            backend=backend,
                            page_size=page_size,
                        )
                pools.append((sidecar, policy, window))
            layout = json.loads(self._settings.l3_layout_with_sidecars(self._backend, pools))
        else:
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
        for sidecar, _ in self._sidecars.values():
            sidecar.close()
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


def _kv_pool_of(pool):
    """The KV host pool of a hybrid model's ``HostPoolGroup`` (its ``kv`` entry, else its anchor), or `pool`."""
    entries = getattr(pool, "entry_map", None)
    if entries is None or not hasattr(pool, "anchor_entry"):
        return pool
    for name, entry in entries.items():
        if _pool_name(name) == "kv":
            return entry.host_pool
    return pool.anchor_entry.host_pool


def _entry_segments(host_pool, indices, entries: int, entry_bytes: int):
    """Where the entries of `indices` lie in a page-first host pool (SGLang's ``get_page_buffer_meta``, whose segments
    follow the flat page's byte order in these layouts): (addresses, lengths, segments per entry), or None where the
    pool does not say or says otherwise (then entries go through flat pages)."""
    if getattr(host_pool, "layout", None) not in ("page_first", "page_first_direct"):
        return None
    try:
        addresses, lengths = host_pool.get_page_buffer_meta(_int64_indices(indices))
    except (AttributeError, NotImplementedError, ValueError, AssertionError):
        return None
    if entries == 0 or len(addresses) % entries or len(lengths) != len(addresses):
        return None
    per_entry = len(addresses) // entries
    if any(isinstance(value, (list, tuple)) for value in (*addresses, *lengths)):
        return None
    addresses, lengths = [int(value) for value in addresses], [int(value) for value in lengths]
    if any(sum(lengths[at : at + per_entry]) != entry_bytes for at in range(0, len(lengths), per_entry)):
        return None
    return addresses, lengths, per_entry


def _sglang_entry_objects(host_pool, name: str, is_mla: bool, entry_bytes: int):
    """How SGLang's Mooncake store cuts an entry of the sidecar pool `name` into objects (its
    ``_get_hybrid_page_component_keys``, 0.5.23): per object its name after the rank, its bytes, and whether its key
    carries the TP rank (``mha_suffix``) or only the stage (``mla_suffix``). The bytes are the pool's own buffers of
    one page (``get_page_buffer_meta``, consecutive buffers packed into one object as SGLang packs them), which
    follow the flat entry's byte order in page-first layouts. None where the pool does not say, where its buffers
    may not follow that order (other layouts: SGLang packs a layer-first MHA pool's per-layer K and V buffers into
    its objects interleaved), or where SGLang's store would not keep it; the Mooncake tier under SGLang's keys then
    refuses the pool."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    single = {str(member.value) for member in PoolName if member.name.startswith("DEEPSEEK_V4_")}
    single |= {str(PoolName.INDEXER.value), str(PoolName.DRAFT_INDEXER.value)}
    if name == str(PoolName.MAMBA.value):
        names = [f"conv_{index}" for index in range(len(getattr(host_pool, "conv_buffer", None) or []))]
        if getattr(host_pool, "temporal_state_elem_size", 1) > 0:
            names.insert(0, "temporal")
        objects = [(object_name, True) for object_name in names]
    elif name == str(PoolName.DRAFT.value):
        mla = isinstance(host_pool, MLATokenToKVPoolHost)
        objects = [("draft_k", False)] if mla else [("draft_k", True), ("draft_v", True)]
    elif name == str(PoolName.DRAFT_SWA.value):
        from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

        if isinstance(host_pool, (DeepSeekV4PagedHostPool, MLATokenToKVPoolHost)):
            objects = [(name, False)]
        elif isinstance(host_pool, MHATokenToKVPoolHost):
            objects = [(f"{name}_k", True), (f"{name}_v", True)]
        else:
            return None
    elif name in single:
        objects = [(name, False)]
    elif name == str(PoolName.SWA.value):
        if not is_mla and hasattr(host_pool, "v_buffer"):
            objects = [(f"{name}_k", True), (f"{name}_v", True)]
        elif is_mla:
            objects = [(name, False)]
        else:
            return None
    else:
        return None
    if not objects or getattr(host_pool, "layout", None) not in ("page_first", "page_first_direct"):
        return None
    try:
        page = torch.arange(getattr(host_pool, "page_size", 1) or 1, dtype=torch.int64)
        _, lengths = host_pool.get_page_buffer_meta(page)
    except (AttributeError, NotImplementedError, ValueError, AssertionError, RuntimeError):
        return None
    if not lengths or len(lengths) % len(objects) or any(isinstance(length, (list, tuple)) for length in lengths):
        return None
    per_object = len(lengths) // len(objects)
    sizes = [sum(int(length) for length in lengths[at : at + per_object]) for at in range(0, len(lengths), per_object)]
    if sum(sizes) != entry_bytes:
        return None
    return [(object_name, size, per_rank) for (object_name, per_rank), size in zip(objects, sizes)]


def _pool_name(name) -> str:
    """The string value of SGLang's ``PoolName`` or ``PoolHitPolicy`` (string enums), or of a plain string."""
    return str(getattr(name, "value", name))


def _flat_page_bytes(page) -> int:
    return page.numel() * page.element_size()


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
