"""butter's MLX back end: mlx-lm model classes, GGUF through ``mx.load``, batched decode."""
