"""LoRA adapters: the mounted set and the stacked multi-adapter layers."""
