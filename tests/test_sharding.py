"""Sharded sides: the mesh cases on 4 CPU host devices (in a subprocess, since JAX fixes its device
count at start and this suite runs on one), handoffs 4 -> 2 and 2 -> 4 over both real transports,
and the link accounting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rekv_jax import Action, ModelConfig, sizes
from rekv_jax.launch.environments import with_host_devices
from rekv_jax.planning.costmodel import Profile

TESTS = Path(__file__).parent


def test_mesh_cases_on_four_host_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                          str(TESTS / "mesh_cases.py")],
                         capture_output=True, text=True, timeout=900, env=env, cwd=TESTS.parent)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


# each transport in one direction (a CLI pair costs minutes on 2 cores); all four combinations
# ran by hand (README "Sharded sides"), and the local transport covers 4 -> 2 in mesh_cases
@pytest.mark.parametrize("transport,sides", [("transfer-server", (4, 2)), ("collective", (2, 4))])
def test_handoff_between_meshes(transport, sides):
    actions = "q8:r=2"  # h_c and a quantized prefix cross, the suffix runs on the decode mesh
    out = subprocess.run(
        [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len", "32", "--actions", actions,
         "--transport", transport, "--schedule", "overlapped", "--warmup", "0", "--reps", "1",
         "--prefill-devices", str(sides[0]), "--decode-devices", str(sides[1]), "--json",
         "--timeout", "300", "--link-gbps", "unpaced"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summaries = [r for r in map(json.loads, out.stdout.splitlines()) if r["kind"] == "summary"]
    n, m = sides
    assert [s["cache_check"] for s in summaries] == [
        f"suffix bitwise, prefix within the q8 error bound to a prefix on {n} devices and a "
        f"suffix on {m}"]
    for s in summaries:
        assert s["first_token_match"] is True
        assert (s["prefill_devices"], s["decode_devices"], s["transport"]) == (n, m, transport)


def test_links_and_per_link_bytes():
    tiny = ModelConfig.preset("tiny")  # 2 KV heads
    assert sizes.kv_shards(tiny, 4) == 2 and sizes.kv_shards(tiny, 3) == 1
    assert sizes.parallel_links(tiny) == sizes.Links(prefix=1, boundary=1)
    assert sizes.parallel_links(tiny, 4, 2) == sizes.Links(prefix=2, boundary=2)
    assert sizes.parallel_links(tiny, 2, 4) == sizes.Links(prefix=2, boundary=4)
    assert sizes.link_bytes(10, 4) == 3 and sizes.link_bytes(8, 4) == 2
    one = Profile.for_config(tiny, 256, quantize_ms={16: 0.0}, restore_ms={16: 0.0},
                             suffix_layer_ms=1.0, join_ms=0.0, hardware="x", link="y",
                             link_gbps=1.0, source="analytic")
    two = Profile.for_config(tiny, 256, prefill_devices=4, decode_devices=2,
                             quantize_ms={16: 0.0}, restore_ms={16: 0.0}, suffix_layer_ms=1.0,
                             join_ms=0.0, hardware="x", link="y", link_gbps=1.0, source="analytic")
    assert two.beta(16) == one.beta(16) / 2  # two parallel links per KV layer
    assert two.boundary_bytes == one.boundary_bytes // 2
    whole = sizes.action_bytes(tiny, Action.parse("q8:r=2", 6), 256).total_bytes
    assert whole == sizes.prefix_bytes(tiny, 256, 4, 8) + sizes.boundary_bytes(tiny, 256)


def test_a_sharded_sides_environment_asks_for_its_host_devices():
    env = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8", "PATH": "/bin"}
    four = with_host_devices(env, 4)
    assert four == {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=4",
                    "PATH": "/bin"}
    assert with_host_devices(four, 1) == four  # one device: nothing to ask for
    assert env["XLA_FLAGS"].endswith("=8")  # the given environment is left as it was
