"""``python -m agentloop``: the command line (see ``agentloop --help``)."""

import sys

from ._cli import main

sys.exit(main())
