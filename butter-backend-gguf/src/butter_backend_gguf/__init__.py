"""butter's GGUF back end (llama.cpp through llama-cpp-python's low-level API)."""
