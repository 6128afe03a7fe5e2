"""The ways a user keeps router gates or norms in fp32 under FSDP2, each as its users apply it.

``harness`` builds one model, applies each peer to a copy of it on every rank, and measures them
side by side (``benchmarks/bench_peers.py`` orchestrates). A peer is a module with ``NAME``,
``SOURCE`` (where the approach comes from, with its version), ``available()`` (``None``, or why it
cannot run in this environment) and ``wrap(model, kept)`` (the FSDP2 wrap, ``kept`` the globs of
parameter names to keep in fp32), which returns what it needed to run as shipped (``""``: nothing).
A peer that patches torch globally or pins other packages runs in a process of its own, from its
own venv.
"""
