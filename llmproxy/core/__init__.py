"""What every part may import: the event hub (`events`), failure descriptions
(`failures`), bounded waits on a clock (`timing`) and many deadlines on one
timed call (`deadlines`); and the reactor's dispatch (`dispatch`), which only
makeService uses. Imports nothing of llmproxy and no twisted.web."""
