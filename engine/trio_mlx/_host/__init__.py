"""Several models on one MLX thread: what can be loaded, which stay loaded, the host."""
