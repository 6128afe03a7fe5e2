"""``python -m fsdp_precision`` runs the CLI."""

import sys

from ._cli import main

sys.exit(main())
