"""The reliability harness of trio-mlx: load, disconnects, faults, hostile input, security, shutdown.

``nox -s soak`` runs ``python -m soak``: every scenario, bounded in count and
time, against a server on 127.0.0.1, then a summary table and a JSON report.
The fast subset in ``tests/test_reliability_*.py`` calls the same scenarios
with small counts.
"""
