"""hicache for Python: SGLang's page keys, and hicache's storage tiers as SGLang's HiCache L3 backend.

``import hicache`` needs neither torch nor SGLang; ``hicache.sglang`` (the backend class SGLang loads) needs both.

- ``page_keys(tokens, page_size, prior=None)``: the chained SHA-256 page keys SGLang computes (64 hex digits each).
- ``namespace_seed(extra_key=None, cache_salt=None)``: the first page's prior for requests with an extra key or a
  cache salt (SGLang 0.5.20 and later), or None.
- ``unified_plan(rank_json)``: one rank's objects under SGLang 0.5.23's unified L3 key scheme (the arguments of its
  ``plan_unified_kv`` as JSON): ``digest``, ``suffixes`` (a page's keys are ``{page_hash}_{suffix}``),
  ``layer_ranges``, ``head_ranges`` and ``encoded`` (the namespace's MessagePack, hex).
- ``BACKENDS``: the storage tiers this build links (its table of tiers, the one the CLI reads too).
"""

from hicache._native import BACKENDS, __version__, namespace_seed, page_keys, unified_plan

__all__ = ["BACKENDS", "__version__", "namespace_seed", "page_keys", "unified_plan"]
