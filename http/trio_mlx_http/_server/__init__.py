"""The server around the routes: the app, Hypercorn's worker, start-up, shared state, metrics."""
