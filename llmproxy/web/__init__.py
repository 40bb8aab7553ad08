"""The HTTP face: the Site and its connections (`site`), the path dispatch
(`routes`), forwarding a request to its engine (`forward`), relaying the answer
(`relay`), and the OpenAI-style error bodies (`errors`). Imports `core`,
`config`, `hosts` and `observe`; never `lifecycle`."""
