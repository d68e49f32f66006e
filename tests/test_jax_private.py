"""JAX's private modules, reached through `rekv_jax.jax_private` only: every private name it uses
is where this JAX has it (a JAX that moved one fails here, by name, not at a pair's start-up),
and outside the supported versions it falls back to public behaviour."""

import jax
import pytest

from rekv_jax import jax_private


def test_this_jax_is_supported_and_has_every_private_name_used():
    assert jax_private.supported(), f"jax {jax.__version__} is outside {jax_private.SUPPORTED}"
    assert jax_private.moved() == [], (
        f"jax {jax.__version__} moved private names rekv_jax uses: {jax_private.moved()}")
    assert jax_private.distributed_state().client is None  # no jax.distributed here
    assert jax_private.cudnn_attention().check_cudnn_version


@pytest.mark.parametrize("version, want", [("0.10.2", True), ("0.11.0", True), ("0.9.9", False),
                                           ("0.12.0", False), ("1.0.0", False)])
def test_the_supported_range_is_0_10_to_0_11(version, want):
    assert jax_private.supported(version) is want


def test_outside_the_range_the_client_keeps_jaxs_own_callback(monkeypatch):
    module = jax_private._distributed()
    before = module._jax
    monkeypatch.setattr(jax_private, "supported", lambda version=None: False)
    with jax_private.client_errors_recorded(print):
        assert module._jax is before  # nothing swapped: JAX's own (aborting) behaviour
    assert jax_private.backends_started() is False
    monkeypatch.undo()
    with jax_private.client_errors_recorded(print):
        assert module._jax is not before  # in range: the client is built with ours
        assert module._jax.get_distributed_runtime_client is not None
    assert module._jax is before
