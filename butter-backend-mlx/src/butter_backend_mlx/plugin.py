"""Registers nothing yet: the MLX back end arrives with its issue.

Kept as an entry point so the plugin wiring is exercised; it must not import mlx.
"""
