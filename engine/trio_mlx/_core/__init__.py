"""The engine's core: the arbiter, the planner, the actor, the MLX worker, the engine."""
