"""What every part may import: the event hub (`events`), failure descriptions
(`failures`) and bounded waits on a clock (`timing`); and the reactor's
dispatch (`dispatch`), which only makeService uses. Imports nothing of
llmproxy and no twisted.web."""
