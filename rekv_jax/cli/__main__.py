"""`python -m rekv_jax.cli`: the `rekv` command."""

from rekv_jax.cli.main import main

main()
