"""CUDA paths: the memory pool, warm-up, the traced decode step, fused kernels."""
