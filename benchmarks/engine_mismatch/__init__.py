"""Helpers of ``benchmarks/bench_engine_mismatch.py``: the trainer's side (:mod:`.trainer`), an
engine's side in a process of its own (:mod:`.engine`) and the statistics (:mod:`.stats`)."""
