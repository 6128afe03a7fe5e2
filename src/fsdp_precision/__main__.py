"""``python -m fsdp_precision`` runs the CLI."""

import sys

from fsdp_precision._cli import main

sys.exit(main())
