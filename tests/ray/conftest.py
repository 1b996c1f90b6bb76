"""tests/ray run real Ray Serve replicas of the real model: without Ray Serve (the
butter-core[ray] extra) or llama.cpp each file skips, unimported."""

from support.absent import skip_without

pytest_pycollect_makemodule = skip_without(
    "ray", "llama_cpp", "butter_backend_gguf",
    reason="Ray Serve or llama.cpp is not installed (butter-core[gguf,ray])")
