"""A real transformers model (a tiny Llama with random weights) computes with KV that hicache brought back.

Multi-turn conversations run through ``hicache.engine.Engine`` with the device (and, every other turn, the host)
emptied between turns, so each returning conversation's prefix comes back from the host tier (L2) or the file tier
(L3). A control engine runs the same conversations with a device pool that holds everything: its prefix KV never
leaves the device. Checks:

- the restored prefix KV is byte-identical to the KV the model wrote into the device slots at the turn before (read
  before it was pushed out), and to the control's;
- the new tokens' logits equal the control's exactly, and the greedy continuations are the same tokens;
- beside a full recompute of the whole prompt with the model's own sdpa attention, the logits agree within float
  tolerance (the largest difference is printed).

With storage faults (a page file's bytes flipped, another replaced by a directory so its read fails), the prefix is
usable up to the first bad page, the rest is recomputed, and the output still agrees.

By cost (the engine reporting its own passes), a tier slower than the model's compute is asked what it holds but not
read: the prompt is computed, and the output agrees the same way. With splits, a tier about as fast as the compute
has its hits split: the engine computes each hit's head while the tail is read, the tail's KV comes back bit for bit,
and the output agrees the same way. An engine that meets the reads (it computes a hit from the front while storage
reads it from the end, and takes the pages read once its compute reaches them) gives the same output wherever the two
meet.

A model whose layers attend to a sliding window (a tiny Qwen2, its upper layers; a tiny Gemma 3, every other layer;
the window shorter than every prompt) gives the same output as its device-only loop and as its own recompute; a
model that asks the attention function for what it does not compute (Gemma 2's logit soft-capping), whose layers
keep a state of their own (Qwen3-Next's linear attention) or whose window reaches the attention function only as a
mask is refused by name.

``HICACHE_TEST_DEVICE=cuda`` runs the same on a GPU (the wheel built with the ``cuda`` feature).
"""

from __future__ import annotations

import glob
import os
import random
import re
import tempfile
import time
import unittest

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

import hicache
from hicache.cache import Cache, token_ids
from hicache.engine import Engine, recompute_logits

PAGE = 16
TURNS = 4
CLIENTS = 3
NEW_TOKENS = 6
TOLERANCE = 1e-4
# the same checks on a GPU (with a wheel built with the cuda feature): HICACHE_TEST_DEVICE=cuda
DEVICE = torch.device(os.environ.get("HICACHE_TEST_DEVICE", "cpu"))


def tiny(model_class, config_class, seed: int, **more):
    """A tiny model of random weights (4 layers of 4 heads over 2 KV heads, 128 wide) on DEVICE; `more` sets the
    rest of its config."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **more,
    )
    return model_class(config).eval().to(DEVICE)


def tiny_llama(seed: int):
    return tiny(LlamaForCausalLM, LlamaConfig, seed)


def assert_served_as_control(test, model, prompt, result, restored, control, what) -> float:
    """One request against the control's: the same prompt, cached prefix, greedy tokens and logits (bit for bit), the
    restored KV the control's; returns the largest logit difference to a full recompute of the prompt."""
    control_prompt, expected, control_kv, _ = control
    test.assertEqual(prompt, control_prompt)
    test.assertEqual(result.cached, expected.cached, f"{what}: cached prefix")
    test.assertEqual(result.tokens, expected.tokens, f"{what}: greedy tokens")
    test.assertTrue(torch.equal(result.logits, expected.logits), f"{what}: logits")
    assert_kv_equal(test, restored, control_kv, result.cached, f"{what}, control")
    full = recompute_logits(model, prompt)[result.cached :]
    return float((full - result.logits).abs().max())


def config(directory: str | None) -> dict:
    settings = {
        "page_size": PAGE,
        "mem_layout": "page_first",
        "hicache_ratio": 2.0,
        "prefetch_policy": "wait_complete",
        "prefetch_threshold": PAGE,
        "model_name": "tiny-llama",
        # these tests check what storage brings back; by cost, a tiny model's small prefixes would be computed
        "prefetch_by_cost": False,
    }
    if directory is not None:
        settings |= {"storage_backend": "file", "storage_backend_extra_config": {"dir": directory}}
    return settings


def page_file(directory: str, key: str) -> str:
    (path,) = glob.glob(os.path.join(directory, "hicache-v1", "*", key[:2], f"{key}.page"))
    return path


class Conversations:
    """Runs CLIENTS conversations of TURNS turns on an engine; prompts grow by fresh random user tokens."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.user = [[[rng.randrange(512) for _ in range(rng.randrange(40, 90))] for _ in range(TURNS)]
                     for _ in range(CLIENTS)]

    def run(self, engine: Engine, between=None) -> dict:
        """Per (client, turn): the prompt, what was served, the prefix KV as restored, and the KV the model wrote
        (the whole sequence's, read from the device slots right after the request)."""
        served, history = {}, [[] for _ in range(CLIENTS)]
        for turn in range(TURNS):
            if between is not None and turn > 0:
                between(turn, history)
            for client in range(CLIENTS):
                prompt = history[client] + self.user[client][turn]
                result = engine.serve(f"c{client}t{turn}", prompt, NEW_TOKENS)
                restored = engine.prefix_kv(result.prefix_slots)
                served[client, turn] = (prompt, result, restored, engine.prefix_kv(result.sequence_slots))
                history[client] = prompt + result.tokens
        return served


def empty_tiers(engine: Engine):
    """Odd turns come back from the host, even turns from storage."""

    def between(turn, _history):
        if turn % 2 == 1:
            engine.empty_device()
        else:
            engine.empty_host()

    return between


def assert_kv_equal(test, restored, written, cached, what):
    """Bit for bit (as integers: a NaN equals itself), the first ``cached`` tokens of every layer."""
    for layer, ((k, v), (written_k, written_v)) in enumerate(zip(restored, written, strict=True)):
        for name, mine, theirs in (("K", k, written_k), ("V", v, written_v)):
            test.assertTrue(
                torch.equal(mine.view(torch.int32), theirs[:cached].view(torch.int32)),
                f"{what}, layer {layer} {name}: restored KV differs from the KV the model wrote",
            )


def assert_restored_as_written(test, served):
    for (client, turn), (_prompt, result, restored, _written) in served.items():
        if turn > 0:
            written = served[client, turn - 1][3]
            assert_kv_equal(test, restored, written, result.cached, f"client {client} turn {turn}")


class ModelOutputUnchanged(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama(seed=random.randrange(1 << 30))
        cls.conversations = Conversations(seed=random.randrange(1 << 30))
        # the control: every conversation stays on the device
        control = Engine(cls.model, config(None), device_tokens=CLIENTS * TURNS * 200 + 1024)
        cls.control = cls.conversations.run(control)
        control.cache.close()

    def test_restored_kv_logits_and_tokens_equal_the_device_only_loop(self):
        with tempfile.TemporaryDirectory() as directory:
            # room for about two conversations: the third pushes pages to the host on its own
            engine = Engine(self.model, config(directory), device_tokens=768)
            served = self.conversations.run(engine, empty_tiers(engine))
            sources = {"host": 0, "storage": 0}
            largest = 0.0
            assert_restored_as_written(self, served)
            for (client, turn), (prompt, result, restored, _written) in served.items():
                control = self.control[client, turn]
                what = f"client {client} turn {turn}"
                difference = assert_served_as_control(self, self.model, prompt, result, restored, control, what)
                largest = max(largest, difference)
                if turn > 0:
                    self.assertEqual(result.loaded, result.cached, "every turn's prefix is loaded back")
                    sources["host" if turn % 2 == 1 else "storage"] += result.loaded
            stats = engine.cache.stats()
            engine.cache.close()
        print(f"\nloaded back: {sources['host']} tokens from the host, {sources['storage']} from storage; "
              f"largest logit difference to a full recompute: {largest:.3g}")
        self.assertGreater(sources["host"], 0)
        self.assertGreater(sources["storage"], 0)
        self.assertGreater(stats["storage"]["get_hits"], 0)
        self.assertLess(largest, TOLERANCE)

    def test_bad_pages_are_recomputed_and_the_output_still_agrees(self):
        with tempfile.TemporaryDirectory() as directory:
            settings = config(directory)
            # pages in a file each, so that one page's file can be damaged
            settings["storage_backend_extra_config"]["segment_threshold"] = 0
            engine = Engine(self.model, settings, device_tokens=768)
            damaged = {}

            def between(turn, history):
                if turn != 2:
                    engine.empty_device()
                    return
                engine.empty_host()
                # client 0: a page's bytes flipped; client 1: a page that cannot be read (a directory in its place)
                for client, damage in ((0, "flip"), (1, "unreadable")):
                    whole = len(history[client]) - len(history[client]) % PAGE
                    keys = hicache.page_keys(history[client][:whole], PAGE)
                    bad = len(keys) // 2
                    path = page_file(directory, keys[bad])
                    if damage == "flip":
                        with open(path, "r+b") as file:
                            file.seek(os.path.getsize(path) // 2)
                            byte = file.read(1)
                            file.seek(-1, os.SEEK_CUR)
                            file.write(bytes([byte[0] ^ 0xFF]))
                    else:
                        os.remove(path)
                        os.mkdir(path)
                    damaged[client] = bad * PAGE

            served = self.conversations.run(engine, between)
            engine.cache.close()
        self.assertEqual(len(damaged), 2)
        assert_restored_as_written(self, served)
        for (client, turn), (prompt, result, _restored, _written) in served.items():
            control_prompt, control, _, _ = self.control[client, turn]
            self.assertEqual(prompt, control_prompt)
            if turn == 2 and client in damaged:
                self.assertEqual(result.cached, damaged[client], f"client {client}: usable up to the bad page")
            else:
                self.assertEqual(result.cached, control.cached)
            self.assertEqual(result.tokens, control.tokens, f"client {client} turn {turn}: greedy tokens")
            full = recompute_logits(self.model, prompt)[result.cached :]
            self.assertLess(float((full - result.logits).abs().max()), TOLERANCE)


    def test_a_tier_slower_than_computing_is_not_read_and_the_output_is_the_same(self):
        with tempfile.TemporaryDirectory() as directory:
            settings = config(directory)
            # by cost: storage said to read at 1 kB/s (and held to 100 kB/s, should the plan read it anyway); the
            # engine's prefill rate comes from its own passes
            settings["prefetch_by_cost"] = True
            settings["prior_storage_read_gbps"] = 1e-6
            settings["storage_backend_extra_config"]["throttle_read_gbps"] = 1e-4
            engine = Engine(self.model, settings, device_tokens=768)
            served = self.conversations.run(engine, empty_tiers(engine))
            stats = engine.cache.stats()
            engine.cache.close()
        storage_turns = 0
        for (client, turn), (prompt, result, _restored, _written) in served.items():
            _, control, _, _ = self.control[client, turn]
            self.assertEqual(result.tokens, control.tokens, f"client {client} turn {turn}: greedy tokens")
            full = recompute_logits(self.model, prompt)[result.cached :]
            self.assertLess(float((full - result.logits).abs().max()), TOLERANCE)
            if turn > 0 and turn % 2 == 0:
                # the host was emptied: storage held the prefix, and computing it was faster
                self.assertEqual((result.cached, result.loaded), (0, 0), f"client {client} turn {turn}")
                storage_turns += 1
        self.assertGreater(storage_turns, 0)
        self.assertEqual(stats["storage"]["get_hits"], 0, "nothing was read from storage")
        self.assertGreater(stats["storage"]["exists_hits"], 0, "storage held the prefixes")

    def kv_bytes_per_token(self) -> int:
        config = self.model.config
        head_dim = config.hidden_size // config.num_attention_heads
        item = next(self.model.parameters()).element_size()
        return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * item

    def kv_bytes_per_s(self) -> float:
        """Bytes of KV the model computes per second on this machine: the median of a few passes of 100 tokens."""
        per_token = self.kv_bytes_per_token()
        tokens = list(range(100))
        times = []
        for _ in range(5):
            started = time.perf_counter()
            recompute_logits(self.model, tokens)
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return per_token * len(tokens) / sorted(times)[len(times) // 2]

    def serve_at_the_compute_rate(self, directory: str, **settings) -> dict:
        """The conversations by cost, the tier held to the rate at which the model computes KV here (where computing
        part of a hit while storage reads the rest beats both reading and computing all of it: by a third for a hit
        as long as the rest of its prompt), with ``settings`` added."""
        gbps = self.kv_bytes_per_s() / 1e9
        config_ = config(directory)
        config_ |= {"prefetch_by_cost": True, "prefetch_split": True, "prior_storage_read_gbps": gbps, **settings}
        config_["storage_backend_extra_config"]["throttle_read_gbps"] = gbps
        engine = Engine(self.model, config_, device_tokens=768)
        # the engine reports its passes at the rate measured above, not as long as each took: on a busy machine a
        # pass can take several times as long, and the plan (which weighs the compute against the tier held to that
        # rate) would then be made on the machine's load rather than on the case this test sets up
        seconds_per_token = self.kv_bytes_per_token() / (gbps * 1e9)
        report = engine.cache.observe_prefill
        engine.cache.observe_prefill = lambda tokens, prefix, _seconds: report(
            tokens, prefix, tokens * seconds_per_token
        )
        served = self.conversations.run(engine, empty_tiers(engine))
        engine.cache.close()
        return served

    def assert_computed_then_read(self, served, computed_first) -> int:
        """Every turn's output is the control's; in the turns where ``computed_first(result)`` (a hit of storage
        alone), the part the engine computed is float-close to the KV written before and the part storage brought
        is that KV bit for bit. Returns how many turns computed first."""
        turns = 0
        for (client, turn), (prompt, result, restored, _written) in served.items():
            _, control, control_kv, _ = self.control[client, turn]
            what = f"client {client} turn {turn}"
            self.assertEqual(result.tokens, control.tokens, f"{what}: greedy tokens")
            full = recompute_logits(self.model, prompt)[result.cached :]
            self.assertLess(float((full - result.logits).abs().max()), TOLERANCE, what)
            if computed_first(result):
                turns += 1
                self.assertTrue(turn > 0 and turn % 2 == 0, f"{what}: only a hit in storage alone")
                # the device part was computed this turn (float-close to the KV written before); what storage
                # brought after it is the KV the model wrote, bit for bit
                computed = result.cached - result.loaded
                self.assertGreaterEqual(computed, result.head, what)
                read = [(k[computed:], v[computed:]) for k, v in restored]
                written = [(k[computed:], v[computed:]) for k, v in control_kv]
                assert_kv_equal(self, read, written, result.loaded, f"{what}, what storage brought")
                for (k, v), (control_k, control_v) in zip(restored, control_kv, strict=True):
                    self.assertLess(float((k[:computed] - control_k[:computed]).abs().max()), TOLERANCE, what)
                    self.assertLess(float((v[:computed] - control_v[:computed]).abs().max()), TOLERANCE, what)
        return turns

    def test_a_hit_split_between_computing_its_head_and_reading_its_tail_gives_the_same_output(self):
        with tempfile.TemporaryDirectory() as directory:
            served = self.serve_at_the_compute_rate(directory)
        splits = self.assert_computed_then_read(served, lambda result: result.head > 0)
        print(f"\nsplit hits: {splits}")
        self.assertGreater(splits, 0, "no hit was split")

    def test_an_engine_that_meets_the_reads_gives_the_same_output_wherever_they_meet(self):
        # the engine computes each storage hit from the front, in passes, while storage reads it from the end, and
        # takes the pages read once its compute reaches them: where that is depends on how fast the reads go, so
        # every turn is checked the same way whatever the split between computed and read came to
        with tempfile.TemporaryDirectory() as directory:
            served = self.serve_at_the_compute_rate(directory, prefetch_meet=True)
        met = self.assert_computed_then_read(served, lambda result: "meet passes" in result.phases)
        results = [result for _, result, _, _ in served.values() if "meet passes" in result.phases]
        computed = sum(result.cached - result.loaded for result in results)
        read = sum(result.loaded for result in results)
        print(f"\nmet hits: {met}: {computed} tokens computed, {read} read")
        self.assertGreater(met, 0, "no hit was met")


class BadInput(unittest.TestCase):
    def kv(self, layers=2, slots=64, dtype=torch.bfloat16):
        k = [torch.zeros(slots, 2, 8, dtype=dtype) for _ in range(layers)]
        v = [torch.zeros(slots, 2, 8, dtype=dtype) for _ in range(layers)]
        return k, v

    def test_tensors_are_checked_by_name(self):
        k, v = self.kv()
        cases = [
            (TypeError, "v[1]: dtype", k, [v[0], v[1].float()]),
            (ValueError, "k[1]: shape", [k[0], torch.zeros(32, 2, 8, dtype=torch.bfloat16)], v),
            (ValueError, "v[0]: not contiguous", k, [v[0].transpose(1, 2).contiguous().transpose(1, 2), v[1]]),
            (TypeError, "k[0]: dtype torch.int32", [torch.zeros(64, 2, 8, dtype=torch.int32)] * 2,
             [torch.zeros(64, 2, 8, dtype=torch.int32)] * 2),
            (ValueError, "v: 1 tensors for 2 layers", k, v[:1]),
        ]
        for error, text, keys, values in cases:
            with self.subTest(text), self.assertRaisesRegex(error, re.escape(text)):
                Cache({"page_size": 16}, keys, values)

    def test_config_fields_slots_layers_and_closed_use_are_named(self):
        k, v = self.kv()
        with self.assertRaisesRegex(ValueError, "page_sise"):
            Cache({"page_sise": 16}, k, v)
        with self.assertRaisesRegex(ValueError, "prefetch_meet`: needs prefetch_split"):
            Cache({"page_size": 16, "prefetch_by_cost": True, "prefetch_meet": True}, k, v)
        cache = Cache({"page_size": 16}, k, v)
        with self.assertRaisesRegex(ValueError, "slots: 64 is out of range"):
            cache.insert(list(range(16)), list(range(48, 65)))
        with self.assertRaisesRegex(ValueError, re.escape("tokens: ids must be in [0, 2^32)")):
            cache.match([-1])
        with self.assertRaisesRegex(ValueError, re.escape("tokens: ids must be in [0, 2^32)")):
            cache.load([1 << 32])
        with self.assertRaises(TypeError):
            cache.match(["a"])
        with self.assertRaisesRegex(ValueError, re.escape("tokens: id -3 is not in [0, 2^32)")):
            token_ids(torch.tensor([1, -3]))
        with self.assertRaisesRegex(TypeError, "tokens: dtype torch.float32"):
            cache.load(torch.tensor([1.0]))
        with self.assertRaisesRegex(ValueError, "slots: -1 is out of range"):
            cache.insert(list(range(16)), [-1] + list(range(1, 16)))
        with self.assertRaisesRegex(TypeError, "slots: dtype torch.float32"):
            cache.insert(list(range(16)), torch.arange(16.0))
        slots = cache.alloc(16)
        # the same ids as a list, a tensor of either width and converted once
        ids = [token_ids(range(16)), torch.arange(16, dtype=torch.int32), torch.arange(16), list(range(16))]
        self.assertEqual(len(ids[0]), 16)
        cache.insert(ids[0], slots)
        for same in ids:
            self.assertEqual(cache.match(same).device_slots.tolist(), slots.tolist())
        cache.drain()
        cache.evict(64)
        load = cache.load(list(range(16)), start=False)
        self.assertEqual(load.loaded, 16)
        with self.assertRaisesRegex(ValueError, "load: not started"):
            load.wait_layer(0)
        load.start()
        with self.assertRaisesRegex(ValueError, "layer: 2 out of range"):
            load.wait_layer(2)
        load.wait_layer(1)
        cache.insert(list(range(16)), load.slots, load)
        with self.assertRaisesRegex(ValueError, "already inserted or released"):
            cache.insert(list(range(16)), load.slots, load)
        with self.assertRaisesRegex(ValueError, "tokens need 5 pages"):
            cache.alloc(5 * 16)
        cache.close()
        with self.assertRaisesRegex(ValueError, "closed"):
            cache.match([1, 2])
        with self.assertRaisesRegex(ValueError, "closed"):
            load.wait_layer(0)


def tiny_qwen2_with_sliding_windows(seed: int):
    """A tiny Qwen2 whose two upper layers attend to a window of WINDOW tokens (shorter than every prompt)."""
    return tiny(
        Qwen2ForCausalLM, Qwen2Config, seed, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
    )


def tiny_gemma3_with_sliding_windows(seed: int):
    """A tiny Gemma 3 (text): every other layer attends to a window of WINDOW tokens, each kind with its own rotary
    base, as Gemma 3 keeps them."""
    return tiny(
        Gemma3ForCausalLM, Gemma3TextConfig, seed, head_dim=32, sliding_window=WINDOW, sliding_window_pattern=2
    )


WINDOW = 24


class SlidingWindowModelOutputUnchanged(unittest.TestCase):
    """A hybrid model of full-attention and sliding-window layers: each sliding layer attends to the keys of its
    window only, as the model's own attention does, whether the prefix stayed on the device or came back from the
    host or storage."""

    def test_restored_kv_logits_and_tokens_equal_the_device_only_loop_and_a_recompute(self):
        for make, types in (
            (tiny_qwen2_with_sliding_windows, ["full", "full", "sliding", "sliding"]),
            (tiny_gemma3_with_sliding_windows, ["sliding", "full", "sliding", "full"]),
        ):
            with self.subTest(model=make.__name__):
                model = make(seed=random.randrange(1 << 30))
                self.assertEqual(model.config.layer_types, [f"{kind}_attention" for kind in types])
                self.served_as_computed(model)

    def served_as_computed(self, model):
        conversations = Conversations(seed=random.randrange(1 << 30))
        control_engine = Engine(model, config(None), device_tokens=CLIENTS * TURNS * 200 + 1024)
        control = conversations.run(control_engine)
        control_engine.cache.close()
        with tempfile.TemporaryDirectory() as directory:
            engine = Engine(model, config(directory), device_tokens=768)
            served = conversations.run(engine, empty_tiers(engine))
            engine.cache.close()
        assert_restored_as_written(self, served)
        largest, loaded = 0.0, 0
        for (client, turn), (prompt, result, restored, _written) in served.items():
            what = f"client {client} turn {turn}"
            difference = assert_served_as_control(self, model, prompt, result, restored, control[client, turn], what)
            largest = max(largest, difference)
            self.assertGreater(len(prompt), WINDOW)
            loaded += result.loaded
        print(f"\n{type(model).__name__}, sliding windows of {WINDOW}: {loaded} tokens loaded back; largest logit "
              f"difference to a full recompute: {largest:.3g}")
        self.assertGreater(loaded, 0)
        self.assertLess(largest, TOLERANCE)

    def test_a_layer_asking_for_what_the_engine_does_not_compute_is_refused_by_name(self):
        torch.manual_seed(0)
        config_ = Gemma2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            attn_logit_softcapping=50.0,
        )
        engine = Engine(Gemma2ForCausalLM(config_).eval().to(DEVICE), config(None), device_tokens=256)
        with self.assertRaisesRegex(NotImplementedError, "layer 0 asks for softcap"):
            engine.serve("r", list(range(40)), 2)
        engine.cache.close()

    def test_a_model_with_layers_that_keep_their_own_state_is_refused_by_name(self):
        # Qwen3-Next: linear-attention layers (a recurrent state) between full-attention ones
        torch.manual_seed(0)
        config_ = Qwen3NextConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_num_value_heads=2,
            linear_num_key_heads=1,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            full_attention_interval=2,
        )
        with self.assertRaisesRegex(NotImplementedError, "layers of type linear_attention are not served"):
            Engine(Qwen3NextForCausalLM(config_).eval().to(DEVICE), config(None), device_tokens=256)
        # chunked attention (Llama 4), which transformers gives the attention function as a mask only
        chunked = tiny_llama(seed=0)
        chunked.config.attention_chunk_size = 32
        with self.assertRaisesRegex(NotImplementedError, "layers of type chunked_attention are not served"):
            Engine(chunked, config(None), device_tokens=256)

    def test_a_layer_that_does_not_attend_or_give_its_window_is_refused_by_name(self):
        # a model without layer types whose second layer keeps a state of its own (here: attends to nothing)
        model = tiny_llama(seed=0)
        model.model.layers[1].self_attn.forward = lambda hidden_states, *args, **kwargs: (hidden_states * 0, None)
        engine = Engine(model, config(None), device_tokens=256)
        with self.assertRaisesRegex(NotImplementedError, re.escape("layers [1] did not attend")):
            engine.serve("r", list(range(40)), 2)
        engine.cache.close()
        # a sliding layer whose window reaches the attention function only as a mask
        model = tiny_qwen2_with_sliding_windows(seed=0)
        model.model.layers[3].self_attn.sliding_window = None
        engine = Engine(model, config(None), device_tokens=256)
        with self.assertRaisesRegex(NotImplementedError, re.escape("sliding-window layers [3] did not say")):
            engine.serve("r", list(range(40)), 2)
        engine.cache.close()

if __name__ == "__main__":
    unittest.main()
