"""A reference engine loop: a transformers decoder model serving multi-turn conversations over ``hicache.Cache``.

The model keeps its own code. One attention function, registered with transformers as ``"hicache"``, is the only
hook: for each layer it writes the new tokens' K and V (after the model's rotary embedding) into their device slots,
waits for that layer of the request's cached prefix to be loaded (``Load.wait_layer``: on the GPU an event wait on
the current stream), reads the prefix's and the new tokens' KV from the slots and runs PyTorch's scaled dot-product
attention over them. Positions are passed to the model, so the rotary embedding of the new tokens continues after the
prefix. A sliding-window layer (transformers' ``sliding_window``: Mistral, Qwen2 and Qwen3 with ``layer_types``)
attends to the keys of its window only, as the model's own attention does; its KV is cached whole like any layer's.
A model whose ``layer_types`` name other kinds of layer (chunked attention, linear attention, state-space layers) is
refused at construction, and a layer that asks for what this function does not compute (attention sinks, logit
soft-capping) raises, naming it, rather than compute other output; so does a pass in which a layer did not attend
through it (a state-keeping layer of a model without ``layer_types``), or a sliding layer did not give its window.

A request (``Engine.serve``): fetch from storage what lies beyond the device and host hit (waiting for it; when the
cache's plan splits the hit, computing its head first while storage reads the tail; with ``prefetch_meet``, computing
the hit from the front in passes while storage reads it from the end, until the two meet), load the
host part back to the device (starting its copies once the forward pass's own small inputs are on the device, so
they do not queue behind the prefix on the copy engine), prefill the rest layer by layer beside the load, decode greedily, insert the whole
sequence (whole pages), tick. When the device pool is full, least recently used pages move to the host (and on to
storage) to make room.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from hicache.cache import Cache, Load, token_ids

_ACTIVE = threading.local()

# Which of sdpa's kernels a pass may use. cuDNN's (PyTorch's first choice on Hopper) builds a plan for each new
# sequence length, measured on an H200: 38 ms on the first causal pass of a length (up to 1 s on the first with a
# [queries, keys] mask), then faster than the others (a causal layer of 5k tokens 0.42 ms against flash's 0.80; a
# 33k-token prompt 1.39 s against 1.78 s). An engine sees a new length with nearly every request (a split's head is
# one by construction), so a pass of fewer than _PLANNED_FROM tokens, which the faster kernel gains less than the
# plan costs, leaves cuDNN out; a longer one puts it first. Both are set explicitly at each pass: the backends sdpa
# may use are process-wide state, and leaving it as found proved unreliable (with nothing set for long passes, a
# 33k-token prompt served after short passes took the 1.78 s of the others).
_PLANNED_FROM = 8192
_UNPLANNED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_PLANNED = [SDPBackend.CUDNN_ATTENTION, *_UNPLANNED]

# The shortest pass of an engine that meets the reads (after its first): a pass has a fixed cost (the eager model
# launches about a thousand kernels), so the passes that close the gap to the reads are not made ever shorter.
_MEET_PASS = 1024


# What transformers passes an attention function that this one does not compute: attention sinks (gpt-oss), logit
# soft-capping (Gemma 2). A layer that asks for one is refused, never served other output.
_UNSERVED = ("s_aux", "softcap")
# The kinds of layer this function serves (transformers' ``layer_types``); a model with others (chunked attention as
# in Llama 4, which transformers gives as a mask only; linear attention; state-space layers) is refused.
_SERVED_LAYERS = ("full_attention", "sliding_attention")


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    step = getattr(_ACTIVE, "step", None)
    if step is None:
        raise RuntimeError("hicache attention called outside Engine.forward")
    unserved = [name for name in _UNSERVED if kwargs.get(name) is not None]
    if unserved:
        raise NotImplementedError(
            f"hicache attention: layer {module.layer_idx} asks for {', '.join(unserved)}, which it does not compute"
        )
    return step.attend(module.layer_idx, query, key, value, scaling, sliding_window)


AttentionInterface.register("hicache", _attention)


class _Step:
    """One forward pass: where its new tokens' KV goes, where its prefix's KV is, which load it waits for."""

    def __init__(self, k, v, prefix: torch.Tensor, new: torch.Tensor, load: Load | None):
        device = k[0].device
        self.k, self.v = k, v
        self.new = new.to(device, non_blocking=True)
        self.all = torch.cat([prefix, new]).to(device, non_blocking=True)
        self.load = load if load is not None and getattr(load, "loaded", 1) else None
        queries, keys = len(new), len(prefix) + len(new)
        # query i (position len(prefix) + i) sees every key up to its own position: with no prefix the plain causal
        # mask (is_causal, which every fused kernel takes), after one the causal mask aligned to the lower right
        # (which flash and memory-efficient attention take as such; a [queries, keys] tensor would send the pass down
        # the slow path); one query sees every key
        self.causal = not len(prefix) and queries > 1
        self.mask = causal_lower_right(queries, keys) if len(prefix) and queries > 1 else None
        self.start = len(prefix)
        # per sliding window: the keys any query of the pass can see, and which each query sees
        self.windows = {}
        # the layers that attended through the slots in this pass, with the sliding window each asked for (None: none)
        self.attended = {}

    def window(self, width: int):
        """A sliding window of ``width`` keys (transformers' ``sliding_window``: the query at position ``p`` sees the
        keys at positions ``p - width + 1`` to ``p``): the slots of the keys any query of the pass sees, and the
        ``[queries, keys]`` mask of which each sees."""
        if width not in self.windows:
            first = max(0, self.start - width + 1)
            device = self.all.device
            queries = torch.arange(self.start, len(self.all), device=device).unsqueeze(1)
            keys = torch.arange(first, len(self.all), device=device).unsqueeze(0)
            self.windows[width] = (self.all[first:], (keys <= queries) & (keys > queries - width))
        return self.windows[width]

    def attend(self, layer, query, key, value, scaling, sliding_window=None):
        self.attended[layer] = sliding_window
        k, v = self.k[layer], self.v[layer]
        k[self.new] = key[0].transpose(0, 1).to(k.dtype)
        v[self.new] = value[0].transpose(0, 1).to(v.dtype)
        if self.load is not None:
            self.load.wait_layer(layer)
        slots, mask, causal = self.all, self.mask, self.causal
        if sliding_window is not None and sliding_window < len(self.all):
            slots, mask = self.window(sliding_window)
            causal = False
        keys = k[slots].transpose(0, 1).unsqueeze(0).to(query.dtype)
        values = v[slots].transpose(0, 1).unsqueeze(0).to(query.dtype)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None


@dataclass
class Served:
    """What one request got: the greedy tokens, the logits of the prompt's computed tokens (``[computed, vocab]``),
    how much of the prompt was cached (on the device, loaded back), the time to its first token, and the device slots
    of the cached prefix and of the whole sequence whose KV it holds (prompt and new tokens but the last)."""

    tokens: list[int]
    logits: torch.Tensor
    cached: int
    loaded: int
    prefetched: bool
    ttft_s: float
    head: int
    # seconds of each step up to the first token: ``query`` (the prefetch's start, and its plan when the engine
    # splits), ``head`` (a split's head computed, or the passes of an engine that meets the reads, with their count
    # in ``meet passes``), ``fetch`` (waiting for the prefetch), ``pass`` (the load and the prefill of the rest)
    phases: dict = field(repr=False)
    prefix_slots: torch.Tensor = field(repr=False)
    sequence_slots: torch.Tensor = field(repr=False)


class Engine:
    """A decoder model (transformers, Llama-like: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``) over a
    device KV pool of ``device_tokens`` slots in per-layer K and V tensors, cached by hicache with ``config``."""

    def __init__(self, model, config: dict, device_tokens: int, kv_dtype: torch.dtype | None = None):
        self.model = model
        model_config = model.config
        types = list(getattr(model_config, "layer_types", None) or [])
        unserved = sorted({kind for kind in types if kind not in _SERVED_LAYERS})
        if unserved or getattr(model_config, "attention_chunk_size", None):
            raise NotImplementedError(
                f"hicache engine: layers of type {', '.join(unserved or ['chunked_attention'])} are not served (only "
                f"{' and '.join(_SERVED_LAYERS)})"
            )
        # the layers that must attend to a sliding window
        self.sliding = {layer for layer, kind in enumerate(types) if kind == "sliding_attention"}
        model_config._attn_implementation = "hicache"
        device = next(model.parameters()).device
        dtype = kv_dtype or next(model.parameters()).dtype
        heads = model_config.num_key_value_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        layers = model_config.num_hidden_layers
        self.k = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.device = device
        self.cache = Cache(config, self.k, self.v)

    def prepare(self, tokens: list[int], start: int, prefix: torch.Tensor, new: torch.Tensor, load=None) -> tuple:
        """What the forward pass of ``tokens[start:]`` needs on the device: token ids, positions, slot indices."""
        ids = torch.tensor(tokens[start:], device=self.device).unsqueeze(0)
        positions = torch.arange(start, len(tokens), device=self.device).unsqueeze(0)
        return ids, positions, _Step(self.k, self.v, prefix, new, load)

    @torch.inference_mode()
    def run(self, prepared: tuple, last_only: bool = False) -> torch.Tensor:
        """The forward pass ``prepare`` set up: logits of its tokens (only the last with ``last_only``)."""
        ids, positions, step = prepared
        _ACTIVE.step = step
        try:
            keep = 1 if last_only else 0
            long = len(step.new) >= _PLANNED_FROM
            with sdpa_kernel(_PLANNED if long else _UNPLANNED, set_priority=long):
                output = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
            # a layer that did not attend through the slots keeps a state of its own the cache does not hold (a
            # linear-attention or state-space layer): after a cached prefix it would start from nothing
            missing = sorted(set(range(len(self.k))) - set(step.attended))
            if missing:
                raise NotImplementedError(
                    f"hicache engine: layers {missing} did not attend through the cache (a linear-attention or "
                    "state-space layer keeps a state of its own, which the cache does not hold yet): not served"
                )
            # a sliding layer whose model gives its window only as a mask would attend to every key here
            windowless = sorted(layer for layer in self.sliding if step.attended.get(layer) is None)
            if windowless:
                raise NotImplementedError(
                    f"hicache engine: sliding-window layers {windowless} did not say their window to the attention "
                    "function (the model gives it as a mask only): not served"
                )
            return output.logits[0]
        finally:
            _ACTIVE.step = None

    def forward(
        self,
        tokens: list[int],
        start: int,
        prefix: torch.Tensor,
        new: torch.Tensor,
        load,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits of ``tokens[start:]`` (positions ``start..``; only the last with ``last_only``), their KV written
        into ``new``, the prefix's read from ``prefix`` once ``load`` (anything with ``wait_layer``) has it."""
        return self.run(self.prepare(tokens, start, prefix, new, load), last_only)

    def serve(
        self,
        request_id: str,
        tokens: list[int],
        max_new_tokens: int,
        prefetch_timeout: float = 60.0,
        all_logits: bool = True,
    ) -> Served:
        """Runs one request: cached prefix from the device, host or storage, the rest computed, ``max_new_tokens``
        greedy tokens; the whole sequence is cached afterwards. Without ``all_logits`` only the last prompt token's
        logits are computed (what the first token needs)."""
        if not tokens or max_new_tokens < 1:
            raise ValueError("a request has at least one prompt token and one new token")
        started = time.perf_counter()
        # at least the last prompt token is computed: its logits give the first new token
        lookup = token_ids(tokens[:-1])
        prefetched = self.cache.prefetch(request_id, lookup)
        head = 0
        marks = [started]
        if prefetched:
            head = self.cache.plan_prefetch(request_id, prefetch_timeout)
            marks.append(time.perf_counter())
            if self.cache.meets:
                head, head_steps = self._meet(request_id, tokens)
            else:
                head_steps = self._compute_head(tokens, head) if head else {}
            marks.append(time.perf_counter())
            self.cache.wait_prefetch(request_id, prefetch_timeout)
        else:
            head_steps = {}
            marks += [started, started]
        marks.append(time.perf_counter())
        load = self.cache.load(lookup, start=False)
        cached = len(load.slots)
        computed = len(tokens) - cached
        fresh = self.cache.alloc(computed + max_new_tokens - 1)
        # the pass's indices go to the device before the prefix's copies, which would hold them up on the copy engine
        prepared = self.prepare(tokens, cached, load.slots, fresh[:computed], load)
        computing = time.perf_counter()
        load.start()
        logits = self.run(prepared, last_only=not all_logits)
        generated = [int(logits[-1].argmax())]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        ttft = now - started
        marks.append(now)
        phases = {name: marks[index + 1] - marks[index] for index, name in enumerate(("query", "head", "fetch", "pass"))}
        phases |= head_steps
        if not load.loaded:
            # nothing was loaded beside it: the pass's time is the prefill's, which the cache weighs storage hits
            # against
            self.cache.observe_prefill(computed, cached, now - computing)
        sequence = list(tokens)
        prefix = torch.cat([load.slots, fresh[:computed]])
        for step in range(max_new_tokens - 1):
            sequence.append(generated[-1])
            slot = fresh[computed + step : computed + step + 1]
            step_logits = self.forward(sequence, len(sequence) - 1, prefix, slot, None, last_only=True)
            prefix = torch.cat([prefix, slot])
            generated.append(int(step_logits[-1].argmax()))
        slots = torch.cat([load.slots, fresh])
        self.cache.insert(sequence, slots, load)
        self.cache.tick()
        return Served(
            generated, logits, cached, load.loaded, prefetched, ttft, head, phases, load.slots, slots[: len(sequence)]
        )

    def _meet(self, request_id: str, tokens: list[int]) -> tuple[int, dict]:
        """An engine that meets the reads: computes the prefetch's tokens from the front, in passes, while storage
        reads them from the end, until its compute reaches the pages read; then takes those (``meet_prefetch``).
        The first pass goes as far as the plan expects the two to meet; each later one half the gap left (at least
        ``_MEET_PASS`` tokens), so a pass costs its fixed overhead only a few times however the reads go. Returns the
        tokens computed and the seconds of its steps (``head pass``: the passes, ``meet passes``: how many), none when
        there were no reads to meet."""
        meeting = self.cache.prefetch_meeting(request_id)
        if meeting is None:
            # no reads to meet (nothing in storage, or nothing worth reading): the prefetch ends as it is
            return 0, {}
        match = self.cache.match(token_ids(tokens[:-1]))
        base = len(match.device_slots) + match.host_tokens
        computed, passes, steps = 0, 0, {"head setup": 0.0, "head pass": 0.0, "head insert": 0.0}
        while meeting is not None:
            unread, planned = meeting
            if computed >= unread:
                self.cache.meet_prefetch(request_id)
                break
            step = planned if passes == 0 and planned > computed else max((unread - computed) // 2, _MEET_PASS)
            upto = min(unread, computed + step)
            upto -= upto % self.cache.page_size
            if upto <= computed:
                upto = unread
            for name, seconds in self._compute_upto(tokens, base + upto).items():
                steps[name] += seconds
            computed, passes = upto, passes + 1
            meeting = self.cache.prefetch_meeting(request_id)
        steps["meet passes"] = passes
        return computed, steps

    def _compute_head(self, tokens: list[int], head: int) -> dict:
        """A split's head: computes the ``head`` tokens after what the cache held of ``tokens`` when the prefetch
        started (the device and host hit) and inserts their KV, while storage reads the tail. Returns the seconds of
        its steps: ``head setup`` (match, load, slots), ``head pass`` (the forward pass), ``head insert``."""
        match = self.cache.match(token_ids(tokens[:-1]))
        return self._compute_upto(tokens, len(match.device_slots) + match.host_tokens + head)

    def _compute_upto(self, tokens: list[int], upto: int) -> dict:
        """Computes ``tokens[:upto]`` past what the cache holds of it and inserts their KV (see ``_compute_head``)."""
        started = time.perf_counter()
        load = self.cache.load(token_ids(tokens[:upto]), start=False)
        cached = len(load.slots)
        fresh = self.cache.alloc(upto - cached)
        prepared = self.prepare(tokens[:upto], cached, load.slots, fresh, load)
        computing = time.perf_counter()
        load.start()
        self.run(prepared, last_only=True)
        if self.device.type == "cuda":
            # the KV is written before the cache copies it to the host
            torch.cuda.current_stream().synchronize()
        computed = time.perf_counter()
        if not load.loaded:
            self.cache.observe_prefill(upto - cached, cached, computed - computing)
        self.cache.insert(token_ids(tokens[:upto]), torch.cat([load.slots, fresh]), load)
        return {
            "head setup": computing - started,
            "head pass": computed - computing,
            "head insert": time.perf_counter() - computed,
        }

    def prefix_kv(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the KV in ``slots``, per layer (K, V)."""
        index = slots.to(self.device)
        return [(k[index].clone(), v[index].clone()) for k, v in zip(self.k, self.v, strict=True)]

    def empty_device(self) -> None:
        """Moves every unlocked page off the device (backed up first)."""
        self.cache.drain()
        self.cache.evict(self.cache.slots)

    def empty_host(self) -> None:
        """Moves every page off the device and the host (once storage holds it)."""
        self.empty_device()
        self.cache.drain()
        self.cache.evict_host(1 << 62)


@torch.inference_mode()
def recompute_logits(model, tokens: list[int]) -> torch.Tensor:
    """The logits of every position of ``tokens`` computed from scratch with the model's own sdpa attention."""
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        device = next(model.parameters()).device
        return model(input_ids=torch.tensor(tokens, device=device).unsqueeze(0), use_cache=False).logits[0]
    finally:
        model.config._attn_implementation = implementation
