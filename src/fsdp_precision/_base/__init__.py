"""Layer 0, what every other layer uses: the error types, dtypes and their one formatter, rank
and sharded-tensor helpers, local process launching, watching a forward, source hashes and the
version. Imports nothing else of the package.
"""
