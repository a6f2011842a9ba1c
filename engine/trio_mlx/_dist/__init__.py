"""Distributed mode: rank 0's leader and the followers that mirror its MLX calls."""
