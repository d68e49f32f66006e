"""The compile clock: what a served record's `compile_ms` is made of."""

import jax
import jax.numpy as jnp

from rekv_jax.serving.compile_clock import compiled_ms


def test_the_clock_counts_each_program_compiled_and_no_cached_call():
    """A jitted function's first call at a shape adds its compile time; the same call again adds
    nothing (the program is cached); a new shape compiles, and adds again."""
    @jax.jit
    def double(x):
        return x * 2 + 1

    start = compiled_ms()
    jax.block_until_ready(double(jnp.ones(7)))
    first = compiled_ms()
    assert first > start
    jax.block_until_ready(double(jnp.ones(7)))
    assert compiled_ms() == first
    jax.block_until_ready(double(jnp.ones(9)))
    assert compiled_ms() > first
