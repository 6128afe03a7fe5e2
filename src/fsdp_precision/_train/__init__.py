"""Layer 9: the training wiring.

The configuration (``config``: :class:`DistributedConfig`), the wrap that chooses units torch can
run and applies the plan, meshes, DDP (``wrap``), and frameworks that call ``fully_shard``
themselves (``integrations``, ``transformers_native``: public through
:mod:`fsdp_precision.integrations`). Checkpoints and exports are the layer below
(:mod:`fsdp_precision._edges`).
"""
