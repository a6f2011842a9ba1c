"""Development tools that are not part of the engine: the bundled model's trainers.

Run from the repository root (``python -m tools.train``, ``python -m tools.train_adapter``,
``python -m tools.instruct``; ``nox -s train-default-model`` / ``train-adapter``). They
write the model data that ships in :mod:`trio_mlx.default_model`; the trainers themselves
(numpy, matplotlib, tqdm) do not ship in the wheel.
"""
