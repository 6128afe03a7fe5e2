"""Layer 1: reading what a checkpoint holds without running it.

``unpickle`` (DCP's ``.metadata`` through an allow-list of globals, stored values as data only,
file names inside the directory) and ``reader`` (DCP's reader and planner on top of them, and the
checks of every data file before a load). Imports nothing of the library but ``_base``: what
reads untrusted bytes stays small enough to audit.
"""
