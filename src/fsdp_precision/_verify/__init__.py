"""Layer 7: parity of a plan-wrapped model against an unsharded reference that computes as FSDP
does, per parameter.

Tensors against their reference (``compare``), the reference itself (``reference``), the check
(``parity``: :func:`verify_parity`) and its typed report (``report``). Public through
:mod:`fsdp_precision.testing`; ``fsdp-precision verify`` runs it on N processes.
"""
