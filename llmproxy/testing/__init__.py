"""Test doubles (`fakes`), the simulated engine (`simengine`) and the demo built
on it (`demo`). Production code never imports this package (the demo only for
`twistd llmproxy --demo`). Nothing is imported here: `tap` imports `demo`
before the systemd environment is read, and the fakes pull in twisted.web."""
