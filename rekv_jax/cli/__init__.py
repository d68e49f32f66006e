"""The `rekv` command; `python -m rekv_jax.cli` runs it."""
