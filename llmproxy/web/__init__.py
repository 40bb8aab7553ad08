"""The HTTP face: the Site and its connections (`site`), the path dispatch
(`routes`), forwarding a request to its engine (`forward`), relaying the answer
(`relay`), the OpenAI-style error bodies (`errors`), and how long a client may
take (`timers`). Imports `core`,
`config`, `hosts` and `observe`; never `lifecycle`."""
