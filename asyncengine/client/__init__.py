"""Client side: input and output processing, engine-core clients. Imports no torch."""
