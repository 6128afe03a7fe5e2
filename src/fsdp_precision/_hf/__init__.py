"""Layer 3: Hugging Face transformers and Diffusers, with the installed library's semantics.

Which keep-in-fp32 declarations apply and what they match (``declarations``), the keep-aware
cast and the dtype-aligned load (``cast``), and transformers' output recording kept across
``fully_shard``'s class swap (``recording``). Public through :mod:`fsdp_precision.hf`.
"""
