"""The whole cache for a PyTorch engine: device KV in the engine's own tensors (L1), a pinned host pool (L2) and a
storage tier (L3), driven by the engine's scheduler.

The engine keeps its KV cache as SGLang's device pools do: per layer a K and a V tensor ``[slots, kv_heads,
head_dim]`` (MHA), or one latent tensor ``[slots, 1, kv_lora_rank + rope_dim]`` (MLA), all on one device (the CPU, or
one CUDA GPU with a build that has the ``cuda`` feature). The cache keeps the allocator of those slots: the engine
asks it for the slots of new tokens (``alloc``), writes their KV there, and inserts them (``insert``); evictions give
slots back. A request's cached prefix comes back with ``load``, whose ``wait_layer(i)`` makes the engine's current
stream wait for layer ``i`` on the GPU (an event wait; the CPU never blocks), so layer ``i``'s attention runs as soon
as its KV has landed while later layers still load. Transfers run on hicache's own streams; the stream current when
the cache is made is the one backups order after (the engine's compute stream).

Every call that can block releases the GIL; no Rust panic reaches Python (``RuntimeError`` instead); bad input raises
``ValueError`` or ``TypeError`` naming the argument; a closed cache raises ``ValueError``.

Config: a dict of ``HiCacheConfig``'s fields (``page_size``, ``hicache_ratio`` or ``hicache_size``, ``mem_layout``,
``write_policy``, ``io_backend`` (``auto`` when not named, not SGLang's ``kernel``: see ``_with_defaults``),
``prefetch_policy``, ``model_name``, ...), the storage tier as ``storage_backend``
(``file``, ``memory``, ``mooncake``) with SGLang's extra config keys in ``storage_backend_extra_config`` (for the file
tier ``dir``, ``format``, ``capacity``, ...).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache import _native

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


Tokens = _native.Tokens


def token_ids(ids) -> Tokens:
    """Token ids converted once (a list, a sequence or a 1-D integer tensor): a request's ``match``, ``prefetch``,
    ``load`` and ``insert`` each take a list or a tensor too, but convert it again at every call (~15 ns a token
    for a list)."""
    with _token_ids():
        ids = _tokens(ids)
        return ids if isinstance(ids, Tokens) else Tokens(ids)


def _tokens(tokens):
    """Token ids as ``Tokens`` (a tensor's read straight from its memory) or a list, which the native side converts
    (each id an unsigned 32-bit integer)."""
    if isinstance(tokens, (Tokens, list)):
        return tokens
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"hicache: tokens: must be one-dimensional, has shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"hicache: tokens: dtype {tokens.dtype} is not torch.int32 or torch.int64")
        tensor = tokens.detach().cpu().contiguous()
        return Tokens.from_address(tensor.data_ptr(), tensor.numel(), tensor.element_size())
    return list(tokens)


@contextlib.contextmanager
def _token_ids():
    """A token id outside an unsigned 32-bit integer, named as the argument it came in."""
    try:
        yield
    except OverflowError:
        raise ValueError("hicache: tokens: ids must be in [0, 2^32)") from None


def _int64(values, name: str) -> torch.Tensor:
    """Slots as a contiguous one-dimensional int64 CPU tensor (the native side checks their range)."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.int64 and values.device.type == "cpu" and values.dim() == 1 and values.is_contiguous():
            return values
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"hicache: {name}: dtype {values.dtype} is not an integer type")
        tensor = values.detach().to("cpu", torch.int64).contiguous()
    else:
        try:
            tensor = torch.tensor(list(values), dtype=torch.int64)
        except (TypeError, RuntimeError, OverflowError) as error:
            raise TypeError(f"hicache: {name}: not a sequence of integers ({error})") from None
    if tensor.dim() != 1:
        raise ValueError(f"hicache: {name}: must be one-dimensional, has shape {tuple(tensor.shape)}")
    return tensor


def _slots(data: bytearray) -> torch.Tensor:
    """The native side's int64 slot bytes as a tensor over them (no copy)."""
    if not data:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(data, dtype=torch.int64)


@dataclass(frozen=True)
class Match:
    """What the cache holds of a token sequence: the device slots of the prefix on the device (int64, CPU), and how
    many tokens after it are on the host."""

    device_slots: torch.Tensor
    host_tokens: int


class Load:
    """A load of a request's cached prefix back to the device (``Cache.load``).

    ``slots`` are the prefix's device slots (int64, CPU): first those that were on the device, then those loaded;
    ``loaded`` counts the latter. Hand it to ``Cache.insert`` (or ``Cache.release``) when the request is done: the
    prefix stays locked on the device until then.
    """

    def __init__(self, native, cache: Cache):
        self._native = native
        self._cache = cache
        self._cuda = cache._cuda
        self.slots = _slots(native.slots())
        self.loaded = native.loaded

    def start(self) -> None:
        """Submits this load (and every other one queued since the last start), layer by layer."""
        self._cache._native.start_load()

    def wait_layer(self, layer: int) -> None:
        """Makes the engine wait until layer ``layer`` is loaded: on the GPU the current torch stream waits for it
        (the CPU goes on); on the CPU it is loaded already."""
        stream = torch.cuda.current_stream().cuda_stream if self._cuda else 0
        self._native.wait_layer(layer, stream)


class Cache:
    """hicache over an engine's device KV tensors. ``k`` and ``v``: per layer a ``[slots, kv_heads, head_dim]`` tensor
    (MHA); or ``latent`` per layer ``[slots, 1, kv_lora_rank + rope_dim]`` with ``mla=(kv_lora_rank, rope_dim)``."""

    def __init__(
        self,
        config: dict,
        k: Sequence[torch.Tensor] | None = None,
        v: Sequence[torch.Tensor] | None = None,
        *,
        latent: Sequence[torch.Tensor] | None = None,
        mla: tuple[int, int] | None = None,
    ):
        if not isinstance(config, dict):
            raise TypeError(f"hicache: config: must be a dict, found {type(config).__name__}")
        if latent is None:
            if k is None or v is None:
                raise ValueError("hicache: k and v (MHA), or latent and mla (MLA), must be given")
            k, v = _tensors(k, "k"), _tensors(v, "v")
            if len(k) != len(v):
                raise ValueError(f"hicache: v: {len(v)} tensors for {len(k)} layers of k")
            first = _check_like(k, "k", k[0])
            _check_like(v, "v", k[0])
            if first.dim() != 3:
                raise ValueError(f"hicache: k[0]: must be [slots, kv_heads, head_dim], has shape {tuple(first.shape)}")
            slots, heads, head_dim = first.shape
            attention = {"kind": "mha", "kv_heads": heads, "head_dim": head_dim}
            tensors = [tensor for pair in zip(k, v, strict=True) for tensor in pair]
        else:
            if k is not None or v is not None:
                raise ValueError("hicache: give k and v (MHA) or latent (MLA), not both")
            if mla is None or len(mla) != 2:
                raise ValueError("hicache: mla: (kv_lora_rank, rope_dim) must be given with latent")
            latent = _tensors(latent, "latent")
            first = _check_like(latent, "latent", latent[0])
            if first.dim() != 3 or first.shape[1] != 1 or first.shape[2] != mla[0] + mla[1]:
                raise ValueError(
                    f"hicache: latent[0]: must be [slots, 1, {mla[0] + mla[1]}], has shape {tuple(first.shape)}"
                )
            slots = first.shape[0]
            attention = {"kind": "mla", "kv_lora_rank": mla[0], "rope_dim": mla[1]}
            tensors = list(latent)
        if first.dtype not in _DTYPES:
            raise TypeError(f"hicache: {'latent' if latent is not None else 'k'}[0]: dtype {first.dtype} is not one of "
                            f"{', '.join(str(dtype) for dtype in _DTYPES)}")
        device = first.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"hicache: {'latent' if latent is not None else 'k'}[0]: device {device} is not cpu or cuda")
        self._cuda = device.type == "cuda"
        self.device = device
        kv = {
            "geometry": {"layers": len(tensors) // (2 if latent is None else 1), "attention": attention,
                         "dtype": _DTYPES[first.dtype]},
            "slots": slots,
            "cuda_device": device.index if self._cuda else None,
            "addresses": [tensor.data_ptr() for tensor in tensors],
            "stream": torch.cuda.current_stream(device).cuda_stream if self._cuda else 0,
        }
        self._native = _native.Cache(json.dumps(_with_defaults(config)), json.dumps(kv), tuple(tensors))
        self.page_size = self._native.page_size
        self.layers = self._native.layers
        self.slots = slots - slots % self.page_size
        # the engine meets the reads (``prefetch_meeting``)
        self.meets = bool(config.get("prefetch_meet", False))

    def match(self, tokens) -> Match:
        """The prefix of ``tokens`` the cache holds on the device, and how much of the rest is on the host."""
        with _token_ids():
            slots, host = self._native.match_prefix(_tokens(tokens))
        return Match(_slots(slots), host)

    def prefetch(self, request_id: str, tokens) -> bool:
        """Starts fetching from storage what of ``tokens`` lies beyond the device and host hit; whether it started."""
        with _token_ids():
            return self._native.prefetch(str(request_id), _tokens(tokens))

    def observe_prefill(self, tokens: int, prefix: int, seconds: float) -> None:
        """Tells the cache that the engine computed ``tokens`` tokens after a prefix of ``prefix`` tokens in
        ``seconds``. The cache weighs its storage hits against this rate and fetches a hit only as far as bringing
        it is faster than computing it; until told (or given ``prior_prefill_tokens_per_s`` in the config), it
        fetches every hit whole."""
        self._native.observe_prefill(int(tokens), int(prefix), float(seconds))

    def plan_prefetch(self, request_id: str, timeout: float = 30.0) -> int:
        """Ticks until ``request_id``'s prefetch plan is known; returns how many tokens at the start of the prefetch
        the engine computes itself (0: none). With ``prefetch_split`` in the config, the plan may *split* a hit that
        is slow to read: the engine computes its head (inserting its KV) while storage reads the tail, then waits for
        the prefetch. Asking for the prefetch (``wait_prefetch``) before the plan is known rules a split out."""
        return self._native.plan_prefetch(str(request_id), float(timeout))

    def prefetch_meeting(self, request_id: str) -> tuple[int, int] | None:
        """For an engine that meets the reads (``prefetch_meet`` in the config, with ``prefetch_split``): while
        ``request_id``'s reads run from the end of its hit, ``(unread, planned)``: the tokens at the prefetch's start
        that are not read yet, and where the plan expects the engine's compute to meet the reads; ``None`` when they
        are not (or no longer) under way. The engine computes from the prefetch's first token, in passes, inserting
        each pass's KV; once it has computed ``unread`` tokens it calls ``meet_prefetch``."""
        return self._native.prefetch_meeting(str(request_id))

    def meet_prefetch(self, request_id: str) -> bool:
        """The engine's compute reached the pages read from the end: the reads stop, and the pages read join the
        cache below what the engine inserted (``wait_prefetch`` returns once they have). False when the reads are not
        under way."""
        return self._native.meet_prefetch(str(request_id))

    def wait_prefetch(self, request_id: str, timeout: float = 30.0) -> bool:
        """Ticks until ``request_id``'s prefetch has joined the cache (True) or ``timeout`` seconds pass (False)."""
        return self._native.wait_prefetch(str(request_id), float(timeout))

    def load(self, tokens, start: bool = True) -> Load:
        """Loads what of ``tokens``' prefix is on the host back to the device, layer by layer, and locks the prefix.
        With ``start=False`` the copies wait for ``Load.start()``: an engine puts what its forward pass needs on the
        device first (indices, token ids), so those small copies do not queue behind the prefix's on the copy
        engine."""
        with _token_ids():
            load = Load(self._native.load(_tokens(tokens)), self)
        if start:
            load.start()
        return load

    def alloc(self, tokens: int) -> torch.Tensor:
        """Device slots (int64, CPU) for ``tokens`` new tokens, in whole pages; evicts when the pool is short."""
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"hicache: tokens: {tokens!r} is not a count of tokens")
        return _slots(self._native.alloc(tokens))

    def insert(self, tokens, slots, load: Load | None = None) -> int:
        """Inserts ``tokens`` whose KV is in ``slots`` (every slot of the request, in whole pages: the prefix's and the
        new ones); whole pages are cached, the other slots go back to the pool; unlocks ``load``'s prefix. Returns the
        tokens that were on the device already."""
        slots = _int64(slots, "slots")
        native = None if load is None else load._native
        with _token_ids():
            return self._native.insert(native, _tokens(tokens), slots.data_ptr(), slots.numel())

    def release(self, load: Load, slots=()) -> None:
        """Unlocks ``load``'s prefix without inserting (a request dropped) and gives back ``slots`` (its new ones)."""
        slots = _int64(slots, "slots")
        self._native.release(load._native, slots.data_ptr(), slots.numel())

    def tick(self) -> dict:
        """One scheduler step: acks, backups to storage, prefetches that finished."""
        return self._native.tick()

    def evict(self, tokens: int) -> int:
        """Evicts at least ``tokens`` device tokens (least recently used first, backed up first); returns how many."""
        return self._native.evict(int(tokens))

    def evict_host(self, tokens: int) -> int:
        """Evicts at least ``tokens`` host tokens no longer needed there; returns how many."""
        return self._native.evict_host(int(tokens))

    def drain(self, timeout: float = 60.0) -> None:
        """Ticks until every host write is acked and every backup to storage is done (``TimeoutError`` after
        ``timeout`` seconds)."""
        self._native.drain(float(timeout))

    def reset(self) -> None:
        """Empties the device and host tiers; storage keeps its pages."""
        self._native.reset()

    def stats(self) -> dict:
        """Counters and occupancy of every tier."""
        return json.loads(self._native.stats())

    def close(self) -> None:
        """Closes the cache; later calls raise ``ValueError``."""
        self._native.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def _with_defaults(config: dict) -> dict:
    """The config with the io backend this cache chooses when none is named: ``auto`` (runs of at least 1 MiB to the
    copy engine, batched where the driver can, shorter ones to the transfer kernel). Under a Llama-8B-shaped model on
    an H200 its loads came closest to ideal (0.977 at a 32k prefix) and slowed the model's compute beside them by
    0.9%; the kernel alone (SGLang's default) slowed it 3.5x (docs/benchmarks.md)."""
    return config if "io_backend" in config else config | {"io_backend": "auto"}


def _tensors(tensors, name: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"hicache: {name}: no tensors")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hicache: {name}[{index}]: not a torch.Tensor ({type(tensor).__name__})")
    return tensors


def _check_like(tensors: list[torch.Tensor], name: str, first: torch.Tensor) -> torch.Tensor:
    for index, tensor in enumerate(tensors):
        where = f"hicache: {name}[{index}]"
        if tensor.dtype != first.dtype:
            raise TypeError(f"{where}: dtype {tensor.dtype} differs from {first.dtype}")
        if tensor.shape != first.shape:
            raise ValueError(f"{where}: shape {tuple(tensor.shape)} differs from {tuple(first.shape)}")
        if tensor.device != first.device:
            raise ValueError(f"{where}: device {tensor.device} differs from {first.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{where}: not contiguous")
    return first
