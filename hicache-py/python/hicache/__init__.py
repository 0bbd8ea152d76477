"""hicache for Python: SGLang's page keys, and hicache's storage tiers as SGLang's HiCache L3 backend.

``import hicache`` needs neither torch nor SGLang; ``hicache.sglang`` (the backend class SGLang loads) needs both.

- ``page_keys(tokens, page_size, prior=None)``: the chained SHA-256 page keys SGLang computes (64 hex digits each).
- ``namespace_seed(extra_key=None, cache_salt=None)``: the first page's prior for requests with an extra key or a
  cache salt (SGLang 0.5.20 and later), or None.
- ``unified_plan(rank_json)``: one rank's objects under SGLang 0.5.23's unified L3 key scheme (the arguments of its
  ``plan_unified_kv`` as JSON): ``digest``, ``suffixes`` (a page's keys are ``{page_hash}_{suffix}``),
  ``layer_ranges``, ``head_ranges`` and ``encoded`` (the namespace's MessagePack, hex).
- ``merge_l3_layouts(layouts)``: SGLang's ``merge_l3_layouts``: the L3 key layouts of several schedulers (each a
  dict, or None for one that gave none; ``HiCacheStorage.describe_l3_object_layout`` gives a stage's) as the one a
  router reads: the stages' pools joined in stage order, or a disabled layout saying why they do not fit.
- ``BACKENDS``: the storage tiers this build links (its table of tiers, the one the CLI reads too).
"""

import json as _json

from hicache._native import BACKENDS, __version__, namespace_seed, page_keys, unified_plan
from hicache._native import merge_l3_layouts as _merge_l3_layouts


def merge_l3_layouts(layouts):
    """SGLang's ``merge_l3_layouts`` over ``layouts`` (dicts, or None): one layout, or None when none was given."""
    return _json.loads(_merge_l3_layouts(_json.dumps(list(layouts))))


__all__ = ["BACKENDS", "__version__", "merge_l3_layouts", "namespace_seed", "page_keys", "unified_plan"]
