"""Time to first token of a returning conversation, under a real model, on one GPU, in one run.

A Llama-3.1-8B-shaped model (transformers, random weights, bf16, nothing downloaded) serves prompts of a cached
prefix (2k, 8k, 32k tokens) and 512 new tokens through ``hicache.engine.Engine``. For each prefix it prints, as
medians of ``--repeats`` runs:

- recompute: the whole prompt through the model's own sdpa attention;
- compute: the 512 new tokens alone, the prefix's KV resident on the device;
- bulk: one host-to-device copy of the prefix's KV (pinned memory), and its GB/s;
- plain torch: one side stream copies the prefix's KV layer by layer while the model computes, each layer's attention
  waiting on its event (the best a plain PyTorch program does);
- hicache L2, per io backend: the prefix in hicache's host tier, loaded layer by layer beside the compute; and the
  same load alone (no compute), beside bulk;
- hicache L3: the prefix only in the file tier (device and host emptied, page cache dropped where allowed), on the
  machine's disk and on tmpfs, beside the raw read speed of the same page files;
- ideal = max(bulk, compute), and ideal / hicache (1.0 is perfect overlap);
- the compute slowdown: the 8k request's forward pass alone, and while hicache loads a 32k prefix for another
  request beside it (per io backend), as a ratio. The pass is replayed from a CUDA graph, so the GPU, not Python
  launching kernels, bounds it (eager where capture fails; the report says which), and timed with events on its
  own stream.

Then the overheads: ``Load.wait_layer`` from Python per layer, and a whole match, load-back and insert per request
of the cache on the CPU engine.

    python hicache-py/bench/model_ttft.py --json out.json    # needs hicache built with the cuda feature
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hicache.cache import Cache
from hicache.engine import _ACTIVE, Engine, _Step

PAGE = 64
NEW = 512
BACKENDS = ("kernel", "direct", "batch", "auto")


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def llama_8b(layers: int, tiny: bool):
    """Llama-3.1-8B's shape (``tiny``: a small model of the same kind, to try the script on a CPU)."""
    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    if tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    config = LlamaConfig(
        vocab_size=128256 if not tiny else 1024,
        num_hidden_layers=layers,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def synchronize():
    if CUDA:
        torch.cuda.synchronize()


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if CUDA else tensor


def stream_ms(body) -> float:
    """The time of ``body``'s work on the current stream alone (events on it), not of other streams' work (which
    may still run: only this stream is waited for first)."""
    if not CUDA:
        return cuda_ms(body)
    torch.cuda.current_stream().synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cuda_ms(body) -> float:
    synchronize()
    start = time.perf_counter()
    body()
    synchronize()
    return (time.perf_counter() - start) * 1e3


def median(values) -> float:
    return statistics.median(values)


def config(io_backend: str, directory: str | None = None) -> dict:
    settings = {
        "page_size": PAGE,
        "mem_layout": "layer_first",
        "io_backend": io_backend,
        "hicache_ratio": 2.5,
        "prefetch_policy": "wait_complete",
        "prefetch_threshold": PAGE,
        "model_name": "llama-3.1-8b-random",
        "storage_batch_pages": 128,
        # this script measures the tiers themselves: every hit fetched whole (bench/cost_ttft.py measures the plan)
        "prefetch_by_cost": False,
    }
    if directory is not None:
        settings |= {"storage_backend": "file", "storage_backend_extra_config": {"dir": directory}}
    return settings


class Workload:
    """Random prompts: per prefix length one prefix and 512 new tokens; new tokens after the same prefix for each
    timed request (what a request inserts must not be cached for the next)."""

    def __init__(self, prefixes, vocab, other: int | None = None):
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(1)
        self.prompts = {p: self.random(p + NEW) for p in prefixes}
        # another request's prefix, as long as the longest, loaded beside a request's compute
        self.longest = other or max(prefixes)
        self.other = self.random(self.longest + NEW)

    def random(self, count: int) -> list[int]:
        return torch.randint(0, self.vocab, (count,), generator=self.generator).tolist()

    def returning(self, prefix: int) -> list[int]:
        return self.prompts[prefix][:prefix] + self.random(NEW)


def populate(engine: Engine, tokens: list[int]):
    """The prefix's KV computed into the cache (and, with write-through, to the host)."""
    engine.serve("populate", tokens + [0], 1, all_logits=False)


def make_resident(engine: Engine, tokens: list[int]):
    """Brings ``tokens``' cached prefix back to the device (if it is on the host) and waits for it."""
    load = engine.cache.load(tokens)
    synchronize()
    engine.cache.release(load)
    engine.cache.tick()


def resident_forward(engine: Engine, prompt: list[int], prefix: int) -> float:
    """The new tokens' forward pass with the prefix on the device (brought there first)."""
    make_resident(engine, prompt[:prefix])
    load = engine.cache.load(prompt[:prefix])
    assert len(load.slots) == prefix and load.loaded == 0, (len(load.slots), load.loaded)
    fresh = engine.cache.alloc(NEW)
    prepared = engine.prepare(prompt, prefix, load.slots, fresh)
    elapsed = stream_ms(lambda: engine.run(prepared, last_only=True))
    synchronize()
    engine.cache.release(load, fresh)
    return elapsed


def graphed(body):
    """``body`` captured as a CUDA graph (its replay), or ``body`` itself where capture fails; and whether it was."""
    if not CUDA:
        return body, False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph.replay, True
    except RuntimeError as error:
        print(f"CUDA graph capture failed ({error}); timing the eager pass", flush=True)
        synchronize()
        return body, False


def slowdown(engine: Engine, prompt: list[int], prefix: int, other: list[int], repeats: int) -> dict:
    """The forward pass of ``prompt``'s new tokens (its ``prefix`` on the device) alone, and while another request's
    prefix ``other`` loads from the host beside it (started just before the pass), on the model's stream."""
    make_resident(engine, prompt[:prefix])
    hold = engine.cache.load(prompt[:prefix])
    assert len(hold.slots) == prefix and hold.loaded == 0, (len(hold.slots), hold.loaded)
    fresh = engine.cache.alloc(NEW)
    prepared = engine.prepare(prompt, prefix, hold.slots, fresh)
    forward, graph = graphed(lambda: engine.run(prepared, last_only=True))
    alone, beside = [], []
    for _ in range(repeats + 1):
        alone.append(stream_ms(forward))
        engine.cache.evict(engine.cache.slots)  # the other request's prefix is on the host now (``hold`` is locked)
        load = engine.cache.load(other)
        assert load.loaded == len(other), (load.loaded, len(other))
        # no synchronization here: the pass runs while the other prefix loads
        beside.append(stream_ms(forward))
        synchronize()
        engine.cache.release(load)
        engine.cache.tick()  # acks the load, which unlocks its pages
    del forward
    synchronize()
    engine.cache.release(hold, fresh)
    return {"alone_ms": median(alone[1:]), "beside_load_ms": median(beside[1:]),
            "ratio": median(beside[1:]) / median(alone[1:]), "cuda_graph": graph}


def load_alone(engine: Engine, tokens: list[int]) -> float:
    """hicache's layer-by-layer load of ``tokens`` from the host with nothing beside it: from its start until the
    model's stream has waited for every layer."""
    engine.empty_device()
    load = engine.cache.load(tokens, start=False)
    assert load.loaded == len(tokens), (load.loaded, len(tokens))

    def body():
        load.start()
        for layer in range(engine.cache.layers):
            load.wait_layer(layer)

    elapsed = stream_ms(body)
    synchronize()
    engine.cache.release(load)
    engine.cache.tick()
    return elapsed


class _Events:
    def __init__(self, events):
        self.events = events

    def wait_layer(self, layer):
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[layer])


def plain_torch(engine: Engine, prompt: list[int], prefix: int, host_k, host_v) -> float:
    """A side stream copies the prefix's KV (pinned, per layer) into per-layer device buffers of the request, one
    copy per layer and part; each layer's attention waits on its event. The model and attention are the engine's."""
    heads, dim = engine.k[0].shape[1:]
    dtype = engine.k[0].dtype
    keys = [torch.empty(prefix + NEW, heads, dim, dtype=dtype, device=DEVICE) for _ in engine.k]
    values = [torch.empty(prefix + NEW, heads, dim, dtype=dtype, device=DEVICE) for _ in engine.v]
    old = torch.arange(prefix)
    new = torch.arange(prefix, prefix + NEW)
    side = torch.cuda.Stream() if CUDA else None

    def run():
        events = []
        # the pass's inputs first: behind the copies on the copy engine they would wait for the whole prefix
        ids = torch.tensor(prompt[prefix:], device=DEVICE).unsqueeze(0)
        positions = torch.arange(prefix, len(prompt), device=DEVICE).unsqueeze(0)
        step = _Step(keys, values, old, new, _Events(events))
        if not CUDA:
            for layer in range(len(keys)):
                keys[layer][:prefix].copy_(host_k[layer])
                values[layer][:prefix].copy_(host_v[layer])
        else:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for layer in range(len(keys)):
                    keys[layer][:prefix].copy_(host_k[layer], non_blocking=True)
                    values[layer][:prefix].copy_(host_v[layer], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
                    events.append(event)
        _ACTIVE.step = step
        try:
            with torch.inference_mode():
                logits = engine.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1).logits
        finally:
            _ACTIVE.step = None
        int(logits[0, -1].argmax())

    return cuda_ms(run)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("1\n")
        return True
    except OSError:
        return False


def raw_read_gbps(directory: str) -> tuple[float, bool]:
    """Reads every page file once (after dropping the page cache where allowed): GB/s."""
    dropped = drop_page_cache()
    paths = glob.glob(os.path.join(directory, "**", "*.page"), recursive=True)
    started, total = time.perf_counter(), 0
    buffer = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while count := file.readinto(buffer):
                total += count
    return total / (time.perf_counter() - started) / 1e9, dropped


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefixes", default="2048,8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument("--other", type=int, help="the prefix loaded beside the compute (default: the longest)")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same kind (tries the script)")
    parser.add_argument("--json")
    args = parser.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    backends = args.backends.split(",")
    model = llama_8b(args.layers, args.tiny)
    config_of = model.config
    per_token = 2 * args.layers * config_of.num_key_value_heads * config_of.head_dim * 2
    work = Workload(prefixes, model.config.vocab_size, args.other)
    # the largest working set on the device: an 8k request beside a 32k load (the rest waits on the host)
    probe = 8192 if 8192 in prefixes else prefixes[0]
    device_tokens = max(*prefixes, work.longest) + probe + 4 * NEW
    report = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "layers": args.layers, "page_size": PAGE, "new_tokens": NEW,
              "prefixes": {}, "slowdown": {}, "overheads": {}}
    rows = {p: {} for p in prefixes}

    # recompute, through the model's own attention
    for p in prefixes:
        prompt = torch.tensor(work.prompts[p], device=DEVICE).unsqueeze(0)
        with torch.inference_mode():
            model.config._attn_implementation = "sdpa"
            cuda_ms(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1))
            rows[p]["recompute_ms"] = median(
                cuda_ms(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1)) for _ in range(args.repeats)
            )

    for backend in backends:
        engine = Engine(model, config(backend), device_tokens)
        for p in prefixes:
            populate(engine, work.prompts[p][:p])
        populate(engine, work.other[: work.longest])
        engine.cache.drain()
        for p in prefixes:
            prompt = work.prompts[p]
            if backend == backends[0]:
                # compute alone, bulk copy, plain torch: once, in the first engine
                resident_forward(engine, prompt, p)
                rows[p]["compute_ms"] = median(resident_forward(engine, prompt, p) for _ in range(args.repeats))
                host = pinned(torch.empty(p * per_token, dtype=torch.uint8))
                device = torch.empty_like(host, device=DEVICE)
                cuda_ms(lambda: device.copy_(host, non_blocking=True))
                rows[p]["bulk_ms"] = median(
                    cuda_ms(lambda: device.copy_(host, non_blocking=True)) for _ in range(args.repeats)
                )
                rows[p]["bulk_gbps"] = p * per_token / rows[p]["bulk_ms"] / 1e6
                del host, device
                slots = engine.cache.match(prompt[:p]).device_slots.to(DEVICE)
                host_k = [pinned(k[slots].cpu()) for k in engine.k]
                host_v = [pinned(v[slots].cpu()) for v in engine.v]
                plain_torch(engine, prompt, p, host_k, host_v)
                rows[p]["plain_torch_ms"] = median(
                    plain_torch(engine, prompt, p, host_k, host_v) for _ in range(args.repeats)
                )
                del host_k, host_v
            times = []
            for _ in range(args.repeats + 1):
                engine.empty_device()
                served = engine.serve(f"l2-{p}", work.returning(p), 1, all_logits=False)
                assert served.cached == p and served.loaded == p, (served.cached, served.loaded)
                times.append(served.ttft_s * 1e3)
            rows[p][f"l2_{backend}_ms"] = median(times[1:])
            loads = [load_alone(engine, prompt[:p]) for _ in range(args.repeats + 1)]
            rows[p][f"l2_{backend}_load_ms"] = median(loads[1:])
        # the compute slowdown: an 8k request's forward pass alone, and beside a 32k load for another request
        engine.empty_device()
        populate(engine, work.prompts[probe][:probe])
        report["slowdown"][backend] = slowdown(
            engine, work.prompts[probe], probe, work.other[: work.longest], args.repeats
        )
        if backend == backends[0]:
            engine.cache.evict(engine.cache.slots)
            load = engine.cache.load(work.other[: work.longest])
            synchronize()
            calls = 1000
            started = time.perf_counter()
            for i in range(calls):
                load.wait_layer(i % args.layers)
            report["overheads"]["wait_layer_us"] = (time.perf_counter() - started) / calls * 1e6
            engine.cache.release(load)
        engine.cache.close()
        del engine
        if CUDA:
            if CUDA:
                torch.cuda.empty_cache()

    print("so far:", json.dumps({"rows": rows, "slowdown": report["slowdown"]}), flush=True)
    # L3: the file tier, on the disk and on tmpfs
    # the io backend hicache.Cache takes when none is named
    default = "auto" if "auto" in backends else backends[0]
    for name, root in (("disk", args.disk_dir), ("tmpfs", "/dev/shm")):
        with tempfile.TemporaryDirectory(dir=root) as directory:
            engine = Engine(model, config(default, directory), device_tokens)
            for p in prefixes:
                populate(engine, work.prompts[p][:p])
            engine.cache.drain(600)
            report[f"{name}_read_gbps"], dropped = raw_read_gbps(directory)
            report[f"{name}_page_cache_dropped"] = dropped
            for p in prefixes:
                times = []
                for repeat in range(args.repeats):
                    engine.empty_host()
                    drop_page_cache()
                    served = engine.serve(f"l3-{p}-{repeat}", work.returning(p), 1, all_logits=False)
                    assert served.cached == p, (served.cached, p)
                    times.append(served.ttft_s * 1e3)
                rows[p][f"l3_{name}_ms"] = median(times)
            engine.cache.close()
            del engine
            if CUDA:
                torch.cuda.empty_cache()

    for p in prefixes:
        row = rows[p]
        row["ideal_ms"] = max(row["bulk_ms"], row["compute_ms"])
        row["plain_torch_of_ideal"] = row["ideal_ms"] / row["plain_torch_ms"]
        for backend in backends:
            row[f"l2_{backend}_load_of_bulk"] = row["bulk_ms"] / row[f"l2_{backend}_load_ms"]
            row[f"l2_{backend}_of_ideal"] = row["ideal_ms"] / row[f"l2_{backend}_ms"]
            row[f"l2_{backend}_speedup"] = row["recompute_ms"] / row[f"l2_{backend}_ms"]
        report["prefixes"][p] = row

    print(f"{report['gpu']}, Llama-3.1-8B shape ({args.layers} layers), bf16, page {PAGE}, {NEW} new tokens; "
          f"medians of {args.repeats}; ms")
    header = ["prefix", "recompute", "compute", "bulk H2D", "plain torch"] + [f"L2 {b}" for b in backends]
    header += ["L3 disk", "L3 tmpfs"]
    print(" | ".join(header))
    for p in prefixes:
        row = rows[p]
        cells = [f"{p}", f"{row['recompute_ms']:.1f}", f"{row['compute_ms']:.1f}",
                 f"{row['bulk_ms']:.1f} ({row['bulk_gbps']:.1f} GB/s)",
                 f"{row['plain_torch_ms']:.1f} ({row['plain_torch_of_ideal']:.3f} of ideal)"]
        cells += [f"{row[f'l2_{b}_ms']:.1f} ({row[f'l2_{b}_of_ideal']:.3f} of ideal, {row[f'l2_{b}_speedup']:.1f}x)"
                  for b in backends]
        cells += [f"{row['l3_disk_ms']:.1f}", f"{row['l3_tmpfs_ms']:.1f}"]
        print(" | ".join(cells))
    print(f"raw read of the page files: disk {report['disk_read_gbps']:.2f} GB/s "
          f"(page cache dropped: {report['disk_page_cache_dropped']}), tmpfs {report['tmpfs_read_gbps']:.2f} GB/s")
    for p in prefixes:
        loads = ", ".join(f"{b} {rows[p][f'l2_{b}_load_ms']:.1f} ({rows[p][f'l2_{b}_load_of_bulk']:.3f} of bulk)"
                          for b in backends)
        print(f"load alone from L2, {p}: {loads}")
    for backend, slow in report["slowdown"].items():
        how = "CUDA graph" if slow["cuda_graph"] else "eager"
        print(f"compute beside a {work.longest} load, {backend}: {slow['beside_load_ms']:.2f} ms vs "
              f"{slow['alone_ms']:.2f} ms alone ({how}): {slow['ratio']:.3f}x")
    print(f"wait_layer from Python: {report['overheads']['wait_layer_us']:.2f} us per layer")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
