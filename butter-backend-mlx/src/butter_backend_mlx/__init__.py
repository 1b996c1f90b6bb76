"""butter's MLX back end (skeleton: the MLX issue fills it in)."""
