"""What both sides of a pair must share for the decode side's recomputed suffix to be bitwise
the prefill side's: the same software on the same kind of device (`agree_runtime`)."""

from __future__ import annotations

import os
from typing import Any

from rekv_jax.errors import RuntimeMismatch
from rekv_jax.launch.environments import HOST_DEVICES_FLAG
from rekv_jax.transport.base import Transport


def runtime(attention: str) -> dict[str, Any]:
    """What decides the bits of this process's programs, beyond the experiment itself."""
    import jax
    import jaxlib

    device = jax.local_devices()[0]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()  # a sharded CPU side's count of
             if not f.startswith(HOST_DEVICES_FLAG)]  # host devices is its own
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": f"{device.platform} {device.client.platform_version}",
            "device_kind": device.device_kind, "xla_flags": " ".join(flags),
            "attention": attention}


def agree_runtime(transport: Transport, attention: str, timeout: float, tag: str = "runtime"
                  ) -> None:
    """Both sides compare `runtime(attention)` under `tag` before any handoff; RuntimeMismatch on
    both, one line naming what differs."""
    try:
        transport.agree(tag, runtime(attention), timeout)
    except ValueError as e:
        raise RuntimeMismatch(f"{e} (the decode side's recomputed suffix would not be bitwise "
                              "the prefill side's)") from None
