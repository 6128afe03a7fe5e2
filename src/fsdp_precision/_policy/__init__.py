"""Layer 2: the per-call contract, in public torch only.

The policy (``policy``), a map resolved against the parameters one ``fully_shard`` call manages
(``resolve``), a model-scoped policy's entries resolved by slot (``scope``), torch 2.15's native
override and what it can express (``native``), and what each release refuses for a call
(``refusals``). Everything here runs before anything is sharded, so a rejected map leaves the
model as it was; the patch (:mod:`fsdp_precision._patch`) calls it from inside ``fully_shard``, a
plan before the first call.
"""
