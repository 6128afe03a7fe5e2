"""Layer 8: the training wiring.

The configuration (``config``: :class:`DistributedConfig`), the wrap that chooses units torch can
run and applies the plan, meshes, DDP (``wrap``), checkpoints (``checkpoint``, public through
:mod:`fsdp_precision.checkpoint`), and frameworks that call ``fully_shard`` themselves
(``integrations``, ``transformers_native``: public through :mod:`fsdp_precision.integrations`).
"""
