"""Pieces of ``benchmarks/bench_gpu.py``: what fits the device (``fit``), and the patch's reduce
copy-in timed at the multi-rank layout on one GPU (``copy_in``)."""
