"""tests/gguf drive the GGUF back end (llama.cpp): without it each file skips, unimported."""

from support.absent import skip_without

pytest_pycollect_makemodule = skip_without(
    "llama_cpp", "butter_backend_gguf", reason="llama.cpp is not installed (butter-core[gguf])")
