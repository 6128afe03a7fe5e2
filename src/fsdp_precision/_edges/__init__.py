"""Layer 8: the edges of a run, everything around the step.

``checkpoint`` (save, load, resume: DCP, atomic), ``entries`` (each tensor's compute dtype and why
it is kept, read from the wrapped model), ``stream`` (the full weights unit by unit:
:func:`fsdp_precision.full_weights`, the hand-off to inference engines), ``layouts`` (what
transformers, Diffusers and PEFT load), ``shards`` (Hugging Face's sharded safetensors),
``export`` / ``offline`` (exports from a model or a checkpoint directory), ``record`` and
``restore`` (what an export kept, and putting it back). Public through
:mod:`fsdp_precision.checkpoint` and :mod:`fsdp_precision`.
"""
