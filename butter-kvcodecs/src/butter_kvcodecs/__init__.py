"""KV-cache codecs for butter."""
