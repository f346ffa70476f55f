"""``python -m lsp_server ...`` = the ``fimble`` command."""

import sys

from lsp_server.cli import main

sys.exit(main())
