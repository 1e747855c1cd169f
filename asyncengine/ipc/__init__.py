"""Wire types and socket helpers: client ↔ core (messages.py), scheduler → workers
(scheduler_output.py), executor ↔ worker processes (worker_messages.py). Imports no torch."""
