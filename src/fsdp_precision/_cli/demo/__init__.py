"""``fsdp-precision demo``: a real distributed training job with exact per-parameter precision.

The demo's application code: the options and the two phases' processes (``command``), the job
each rank runs (``job``) and its typed results (``results``), the model (``model``), and what is
printed (``present``).
"""

from fsdp_precision._cli.demo.command import DemoOptions, run

__all__ = ["DemoOptions", "run"]
