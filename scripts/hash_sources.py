"""Print the ``SOURCES`` table of a release module for the torch installed in this environment.

    python scripts/hash_sources.py                      # implementation of the installed release
    python scripts/hash_sources.py --implementation _impl_v2_13   # for a new release module

Run it in a venv holding the torch release the module is for (see scripts/compat.py), then paste
the table into ``src/fsdp_precision/_patch/v2_NN.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from fsdp_precision._patch import SUPPORTED_RELEASES, torch_release  # noqa: E402
from fsdp_precision._patch._sources import resolve, source_sha256  # noqa: E402
from fsdp_precision._patch._targets import TARGETS, targets  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--implementation",
        choices=sorted(TARGETS),
        help="whose targets to hash (default: that of the installed release's module)",
    )
    implementation = parser.parse_args(argv).implementation
    if implementation is None:
        name = SUPPORTED_RELEASES.get(torch_release())
        if name is None:
            parser.error(
                f"torch {torch.__version__} has no release module yet; pass --implementation"
            )
        implementation = importlib.import_module(f"fsdp_precision._patch.{name}").IMPLEMENTATION
    print(f"# torch {torch.__version__}, targets of {implementation}")
    print("SOURCES: dict[str, str] = {")
    for target in targets(implementation):
        print(f'    "{target}": "{source_sha256(resolve(target))}",')
    print("}")


if __name__ == "__main__":
    main()
