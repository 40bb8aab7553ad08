"""`python -m llmproxy.cli`: the ``llmproxy`` command."""

import sys

from llmproxy.cli.main import main

sys.exit(main())
