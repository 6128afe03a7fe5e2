"""Print (or check) the ``SOURCES`` table of a release module for the torch installed here.

    python scripts/hash_sources.py                  # the table for the installed release
    python scripts/hash_sources.py --check          # exit 1 unless the release module agrees
    python scripts/hash_sources.py --traits-of 2.14 # a new release: hash what 2.14's traits need

The functions hashed follow the release's ``TRAITS``
(``fsdp_precision._releases.traits.hashed_functions``).
Run it in a venv holding the torch release the module is for (see scripts/compat.py), then paste
the table into ``src/fsdp_precision/_releases/v2_NN.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from fsdp_precision._base.sources import lookup, source_sha256  # noqa: E402
from fsdp_precision._releases import (  # noqa: E402
    SUPPORTED_RELEASES,
    release_module_name,
    torch_release,
)
from fsdp_precision._releases.traits import hashed_functions  # noqa: E402


def _release_module(release: str) -> ModuleType:
    return importlib.import_module(f"fsdp_precision._releases.{release_module_name(release)}")


def _hash(target: str) -> str:
    try:
        return source_sha256(lookup(target))
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        return f"<missing: {exc}>"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traits-of",
        choices=SUPPORTED_RELEASES,
        help="whose traits decide the hashed functions (default: the installed release's)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the installed release's SOURCES instead of printing; exit 1 on a "
        "difference",
    )
    args = parser.parse_args(argv)
    installed = torch_release()
    like = args.traits_of or installed
    if like not in SUPPORTED_RELEASES:
        parser.error(f"torch {torch.__version__} has no release module yet; pass --traits-of")
    hashes = {target: _hash(target) for target in hashed_functions(_release_module(like).TRAITS)}
    if args.check:
        if installed not in SUPPORTED_RELEASES:
            parser.error(f"torch {torch.__version__} has no release module to check")
        recorded = _release_module(installed).SOURCES
        if list(recorded.items()) == list(hashes.items()):
            name = release_module_name(installed)
            print(f"torch {torch.__version__}: the {len(hashes)} hashes agree with {name}.py")
            return 0
        for target in dict.fromkeys([*recorded, *hashes]):
            if recorded.get(target) != hashes.get(target):
                print(f"differs: {target} recorded {recorded.get(target)} now {hashes.get(target)}")
        return 1
    print(f"# torch {torch.__version__}, functions hashed by the {like} traits")
    print("SOURCES: dict[str, str] = {")
    for target, sha in hashes.items():
        print(f'    "{target}": "{sha}",')
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
