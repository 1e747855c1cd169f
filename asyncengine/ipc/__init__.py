"""Wire types and socket helpers between the client and the engine core. Imports no torch."""
