"""``python -m trio_mlx_http``: the same as the ``trio-mlx`` command."""

from trio_mlx_http._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
