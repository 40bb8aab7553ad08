"""What every part may import: the event hub (`events`), failure descriptions
(`failures`) and bounded waits on a clock (`timing`). Imports nothing of
llmproxy and no twisted.web."""
