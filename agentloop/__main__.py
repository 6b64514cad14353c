"""``python -m agentloop``: the command line (see ``agentloop --help``)."""

import sys

from ._cli_main import main

sys.exit(main())
