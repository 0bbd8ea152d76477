"""Time to first token of a returning conversation whose prefix is only in storage, with every hit fetched whole
(SGLang's way), with hicache's cost plan (a hit fetched only as far as bringing it is faster than computing it) and
with the plan allowed to split a hit (the engine computes its head while storage reads its tail), and with an engine
that meets the reads (it computes the hit from the front, in passes, while storage reads it from the end, and takes
the pages read once its compute reaches them), beside recomputing the whole prompt, under a real model on one GPU, in
one run.

A Llama-3.1-8B-shaped model (transformers, random weights, bf16) serves a cached prefix (2k, 8k, 32k tokens) and 512
new tokens through ``hicache.engine.Engine``, the prefix in the file tier on tmpfs only (device and host emptied
before each request): at the tier's own speed, and held to ``--throttle`` GB/s (``throttle_read_gbps``). The cost
plan learns the model's prefill rate from the engine's own passes and the tier's rate from its reads (the first
request of each prefix is not timed: it may be the one that measures the tier; before them each prefix is served
once from the device, as a serving engine's device hits teach it the cost of a pass after a prefix); the
host-to-device rate, which the reference engine does not time, is given (``--load-gbps``). For each prefix and tier it prints
the medians of ``--repeats`` requests: recompute (the whole prompt through the model's own sdpa attention), whole
(every hit fetched, then the rest computed), by cost, split (by cost, splits allowed), meet (splits allowed, the
reads met), and each of the last three against the better of the first two.

    python hicache-py/bench/cost_ttft.py --json out.json    # needs hicache built with the cuda feature
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from model_ttft import CUDA, DEVICE, NEW, Workload, config, cuda_ms, llama_8b, median, populate


MODES = ("whole", "by cost", "split", "meet")


def engine_config(directory: str, mode: str, throttle: float | None, load_gbps: float) -> dict:
    settings = config("auto", directory)
    settings["prefetch_by_cost"] = mode != "whole"
    settings["prefetch_split"] = mode in ("split", "meet")
    settings["prefetch_meet"] = mode == "meet"
    # the reference engine does not time its loads: the host-to-device rate is given
    settings["prior_load_gbps"] = load_gbps
    if throttle is not None:
        settings["storage_backend_extra_config"]["throttle_read_gbps"] = throttle
    return settings


def main():
    from hicache.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefixes", default="2048,8192,32768")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throttle", type=float, default=2.0, help="GB/s the throttled tier is held to")
    parser.add_argument("--load-gbps", type=float, default=50.0,
                        help="the host-to-device rate the plan assumes (the H200's bulk copy: 53 GB/s)")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same kind (tries the script)")
    parser.add_argument("--json")
    args = parser.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    model = llama_8b(args.layers, args.tiny)
    work = Workload(prefixes, model.config.vocab_size)
    device_tokens = max(prefixes) + 4 * NEW
    report = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "layers": args.layers, "new_tokens": NEW,
              "throttle_gbps": args.throttle, "prefixes": {p: {} for p in prefixes}}
    for p in prefixes:
        prompt = torch.tensor(work.prompts[p], device=DEVICE).unsqueeze(0)
        with torch.inference_mode():
            model.config._attn_implementation = "sdpa"
            cuda_ms(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1))
            report["prefixes"][p]["recompute_ms"] = median(
                cuda_ms(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1)) for _ in range(args.repeats)
            )
    for tier, throttle in (("tmpfs", None), (f"{args.throttle:g} GB/s", args.throttle)):
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
                engine = Engine(model, engine_config(directory, mode, throttle, args.load_gbps), device_tokens)
                for p in prefixes:
                    populate(engine, work.prompts[p][:p])
                    # a returning request while the prefix is still on the device: the engine's pass after a prefix,
                    # which it reports (as a serving engine's passes after device hits are)
                    engine.serve(f"resident-{p}", work.returning(p), 1, all_logits=False)
                engine.cache.drain(600)
                for p in prefixes:
                    times, cached, heads, phases = [], [], [], []
                    for repeat in range(args.repeats + 1):
                        engine.empty_host()
                        served = engine.serve(f"{tier}-{mode}-{p}-{repeat}", work.returning(p), 1, all_logits=False)
                        if repeat > 0:
                            times.append(served.ttft_s * 1e3)
                            # tokens taken from storage (a split's head, and what an engine that meets the reads
                            # computed before it met them, are computed)
                            cached.append(served.cached - served.head)
                            heads.append(served.head)
                            phases.append(served.phases)
                    name = f"{tier} {mode}"
                    report["prefixes"][p][f"{name} ms"] = median(times)
                    report["prefixes"][p][f"{name} cached"] = median(cached)
                    report["prefixes"][p][f"{name} head"] = median(heads)
                    report["prefixes"][p][f"{name} phases ms"] = {
                        phase: median(step.get(phase, 0.0) * 1e3 for step in phases)
                        for phase in dict.fromkeys(key for step in phases for key in step)
                    }
                engine.cache.close()
                del engine
                if CUDA:
                    torch.cuda.empty_cache()
    print(f"{report['gpu']}, Llama-3.1-8B shape ({args.layers} layers), bf16, {NEW} new tokens after the prefix, the "
          f"prefix only in the file tier on tmpfs; medians of {args.repeats}; ms (tokens taken from storage)")
    for tier in ("tmpfs", f"{args.throttle:g} GB/s"):
        print(f"tier: {tier}")
        print("prefix | recompute | whole | by cost | split (head computed) | meet (computed) | by cost, split, meet / "
              "min(recompute, whole)")
        for p in prefixes:
            row = report["prefixes"][p]
            whole, planned, split, meet = (row[f"{tier} {mode} ms"] for mode in MODES)
            best = min(row["recompute_ms"], whole)
            row[f"{tier} by cost of best"] = planned / best
            row[f"{tier} split of best"] = split / best
            row[f"{tier} meet of best"] = meet / best
            print(f"{p} | {row['recompute_ms']:.1f} | {whole:.1f} ({row[f'{tier} whole cached']:.0f}) | "
                  f"{planned:.1f} ({row[f'{tier} by cost cached']:.0f}) | "
                  f"{split:.1f} ({row[f'{tier} split cached']:.0f}, {row[f'{tier} split head']:.0f}) | "
                  f"{meet:.1f} ({row[f'{tier} meet cached']:.0f}, {row[f'{tier} meet head']:.0f}) | "
                  f"{planned / best:.3f}, {split / best:.3f}, {meet / best:.3f}")
            for mode in MODES:
                steps = ", ".join(f"{phase} {ms:.1f}" for phase, ms in row[f"{tier} {mode} phases ms"].items())
                print(f"    {mode}: {steps}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
