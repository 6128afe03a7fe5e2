"""Routing replay: the trainer's MoE routers pick the experts an inference engine picked.

:mod:`.routers` finds the routers of a Hugging Face model (per-family knowledge as data),
:mod:`.formats` reads the engines' routes, :mod:`.layout` aligns them with a batch as its tokens
are aligned, and :mod:`.replay` replays them inside each router's own forward. Public through
:mod:`fsdp_precision.replay`.
"""
