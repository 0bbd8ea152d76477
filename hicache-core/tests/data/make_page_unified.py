#!/usr/bin/env python3
"""Golden vectors of SGLang 0.5.23's `page_unified` host layout, made by SGLang's own code.

Command that made sglang_0_5_23_page_unified.json (run from the repository root; needs pip and PyPI):

    python3 hicache-core/tests/data/make_page_unified.py > hicache-core/tests/data/sglang_0_5_23_page_unified.json

It downloads the sglang==0.5.23 wheel (no dependencies) and msgspec into a temporary folder and calls, unchanged,
`PageUnifiedLayout` of sglang/srt/mem_cache/pool_host/page_unified.py (which imports only msgspec) on 48 random
valid layouts (seeded): per layout its `bytes_per_page`, its `page_dims` for three pages (whose C order is the byte
order) and `chunk_span` of random layer ranges and head groups; and on five layouts it refuses.
"""
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODULE = "sglang/srt/mem_cache/pool_host/page_unified.py"


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
        archive.extract(MODULE, folder / "src")
    sys.path[:0] = [str(folder / "lib"), str(folder / "src" / Path(MODULE).parent)]
    import page_unified

    return page_unified


def main():
    with tempfile.TemporaryDirectory() as folder:
        module = load(Path(folder))
        rng = random.Random(20261203)
        cases = []
        while len(cases) < 48:
            mla = rng.random() < 0.25
            itemsize = rng.choice([1, 2, 4])
            head_num = 1 if mla else rng.choice([1, 2, 4, 8])
            groups = 1 if mla else rng.choice([g for g in (1, 2, 4, 8) if head_num % g == 0])
            head_dim = rng.choice([576, 512] if mla else [64, 128, 256])
            args = dict(
                page_size=rng.choice([1, 2, 16, 64]),
                layer_num=rng.choice([1, 3, 32, 61]),
                head_num=head_num,
                head_group_num=groups,
                head_dim=head_dim,
                itemsize=itemsize,
                is_mla=mla,
            )
            layout = module.PageUnifiedLayout(**args)
            spans = []
            for _ in range(4):
                start = rng.randrange(layout.layer_num)
                end = rng.randrange(start + 1, layout.layer_num + 1)
                group = rng.randrange(layout.head_group_num)
                spans.append({"layers": [start, end], "head_group": group,
                              "span": list(layout.chunk_span((start, end), group))})
            cases.append({"layout": args, "bytes_per_page": layout.bytes_per_page,
                          "page_dims": list(layout.page_dims(3)), "spans": spans})
        refused = []
        for args in (
            dict(page_size=4, layer_num=2, head_num=6, head_group_num=4, head_dim=128, itemsize=2),
            dict(page_size=4, layer_num=2, head_num=1, head_group_num=2, head_dim=576, itemsize=1, is_mla=True),
            dict(page_size=0, layer_num=2, head_num=2, head_group_num=1, head_dim=128, itemsize=2),
            dict(page_size=4, layer_num=2, head_num=2, head_group_num=2, head_dim=4, itemsize=2),
            dict(page_size=4, layer_num=2, head_num=2, head_group_num=0, head_dim=128, itemsize=2),
        ):
            try:
                module.PageUnifiedLayout(**args)
            except ValueError as error:
                refused.append({"layout": args, "error": str(error)})
            else:
                raise SystemExit(f"SGLang took {args}")
        json.dump({"sglang": "0.5.23", "cases": cases, "refused": refused}, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
