"""Print the ``SOURCES`` table of a release module for the torch installed in this environment.

    python scripts/hash_sources.py            # paste into src/fsdp_precision/_patch/v2_NN.py

Run it in a venv holding the torch release the module is for (see scripts/compat.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from fsdp_precision._patch._sources import resolve, source_sha256  # noqa: E402
from fsdp_precision._patch._targets import RELIED_ON, REPLACED  # noqa: E402


def main() -> None:
    print(f"# torch {torch.__version__}")
    print("SOURCES: dict[str, str] = {")
    for target in REPLACED + RELIED_ON:
        print(f'    "{target}":\n        "{source_sha256(resolve(target))}",')
    print("}")


if __name__ == "__main__":
    main()
