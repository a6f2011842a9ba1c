"""Starting an engine: the backend's BLAS and loading a model with its settings."""
