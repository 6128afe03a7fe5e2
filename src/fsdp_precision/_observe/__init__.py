"""Layer 6: observe what FSDP actually does, never infer it.

Collectives on the wire (``collectives``), parameters as their units gathered them
(``gathers``), and the runtime guard that names a module used outside its unit (``guard``).
Public through :mod:`fsdp_precision.testing`; the verify command, the demo, the tests and the
benchmarks use the same instruments.
"""
