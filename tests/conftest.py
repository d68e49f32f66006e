"""One persistent JAX compilation cache for the whole run, shared with every child process the
tests start (a handoff's two processes, the CLI runs, the mesh cases): without it each starts
cold and compiles the same tiny programs again. Set before anything imports JAX."""

import os
import shutil
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="rekv-tests-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(scope="session", autouse=True)
def _remove_the_cache():
    yield
    shutil.rmtree(_CACHE, ignore_errors=True)
