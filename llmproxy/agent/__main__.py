"""`python -m llmproxy.agent`: the agent, as `llmproxy-agent` runs it."""

import sys

from llmproxy.agent.main import main

sys.exit(main())
