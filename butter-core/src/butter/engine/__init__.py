"""The engine: one thread owns the back end's native objects and runs every session."""
