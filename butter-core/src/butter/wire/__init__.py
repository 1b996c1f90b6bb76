"""Wire formats: each API dialect parsed into a ChatRequest and rendered back, no I/O."""
