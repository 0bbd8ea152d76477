#!/usr/bin/env python3
"""Golden vectors of SGLang 0.5.23's unified L3 key scheme, made by SGLang's own code.

Command that made sglang_0_5_23_unified_keys.json (run from the repository root; needs pip and PyPI):

    python3 hicache-core/tests/data/make_unified_keys.py > hicache-core/tests/data/sglang_0_5_23_unified_keys.json

It downloads the sglang==0.5.23 wheel (no dependencies) and msgspec into a temporary folder, and calls, unchanged,
`plan_unified_kv` and `namespace_digest` of sglang/srt/mem_cache/hicache_key_scheme.py (which imports only msgspec
and the layout name of sglang/srt/mem_cache/pool_host/page_unified.py, both taken from the wheel) on 64 random valid
deployments (seeded) and on ten that it refuses.
"""
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODULES = ("sglang/srt/mem_cache/hicache_key_scheme.py", "sglang/srt/mem_cache/pool_host/page_unified.py")


def load(folder: Path):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "sglang==0.5.23", "-d", str(folder)],
        check=True,
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(folder / "lib"), "msgspec"], check=True
    )
    wheel = next(folder.glob("sglang-0.5.23-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        for name in MODULES:
            archive.extract(name, folder / "src")
    # page_unified.py imports torch for its pool; the key scheme needs only its layout name
    page_unified = folder / "src" / MODULES[1]
    name = next(line for line in page_unified.read_text().splitlines() if line.startswith("PAGE_UNIFIED_OBJECT_LAYOUT"))
    page_unified.write_text(name + "\n")
    sys.path[:0] = [str(folder / "lib"), str(folder / "src")]
    import msgspec
    from sglang.srt.mem_cache import hicache_key_scheme

    return msgspec, hicache_key_scheme


def main():
    with tempfile.TemporaryDirectory() as folder:
        msgspec, scheme = load(Path(folder))
        rng = random.Random(20261203)
        models = ["meta-llama/Llama-3.1-8B-Instruct", "deepseek-ai/DeepSeek-V3", "m", "Qwen/Qwen3-235B-A22B", "x" * 40]
        models.append("模型/ü")
        dtypes = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float32"]
        cases = []
        while len(cases) < 64:
            replicated = rng.random() < 0.25
            tp = rng.choice([1, 2, 4, 8])
            local = 1 if replicated else rng.choice([1, 2, 4, 8])
            layers = rng.choice([1, 7, 32, 61, 80, 126])
            pp = rng.choice([1, 1, 2, 4])
            stage = rng.randrange(pp)
            per = max(layers // pp, 1)
            start = min(stage * per, layers - 1)
            end = layers if stage == pp - 1 else max(start + 1, (stage + 1) * per)
            partition = rng.choice([None, None, 1, 2, 4, 8, 16])
            if partition is not None and start % partition:
                partition = None
            head_group = None if replicated else rng.choice([None, 1, 2, 4, 8])
            if head_group is not None and local % head_group:
                head_group = None
            if head_group is None and local == 1 and tp > 1 and not replicated:
                head_group = 1
            args = dict(
                model_id=rng.choice(models),
                dtype=rng.choice(dtypes),
                page_size=rng.choice([1, 16, 32, 64, 128, 256, 4096, 70000, 5000000000]),
                rank_replicated=replicated,
                local_kv_heads=local,
                attn_tp_rank=rng.randrange(tp),
                attn_tp_size=tp,
                attn_cp_size=1,
                start_layer=start,
                end_layer=end,
                is_final_stage=stage == pp - 1,
                head_group=head_group,
                layer_partition=partition,
            )
            try:
                plan = scheme.plan_unified_kv(**args)
            except ValueError:
                continue
            cases.append(
                {
                    "args": args,
                    "encoded": msgspec.msgpack.encode(plan.namespace).hex(),
                    "digest": scheme.namespace_digest(plan.namespace),
                    "suffixes": plan.suffixes,
                    "layer_ranges": [list(bounds) for bounds in plan.layer_ranges],
                    "head_ranges": [list(bounds) for bounds in plan.head_ranges],
                }
            )
        base = dict(
            model_id="m", dtype="bfloat16", page_size=64, rank_replicated=False, local_kv_heads=8, attn_tp_rank=0,
            attn_tp_size=1, attn_cp_size=1, start_layer=0, end_layer=32, is_final_stage=True,
        )
        refused = []
        for change in [
            {"model_id": ""},
            {"page_size": 0},
            {"attn_cp_size": 2},
            {"start_layer": 4, "end_layer": 4},
            {"local_kv_heads": 1, "attn_tp_size": 2},
            {"head_group": 3},
            {"head_group": 0},
            {"start_layer": 2, "layer_partition": 4},
            {"end_layer": 30, "is_final_stage": False, "layer_partition": 4},
            {"head_group": 16},
        ]:
            args = {**base, **change}
            try:
                scheme.plan_unified_kv(**args)
                error = None
            except (ValueError, NotImplementedError) as raised:
                error = type(raised).__name__
            refused.append({"args": args, "error": error})
        source = f"sglang 0.5.23 hicache_key_scheme.py (plan_unified_kv, namespace_digest), msgspec {msgspec.__version__}"
        print(json.dumps({"source": source, "cases": cases, "refused": refused}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
