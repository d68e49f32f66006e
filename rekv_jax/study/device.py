"""The device this process computes on, as results name it: a summary's `hardware` label and
the device fields of a bench or doctor result."""

from __future__ import annotations

import dataclasses
import platform

import jax


@dataclasses.dataclass(frozen=True)
class Device:
    """This process's first local device and what else its results depend on."""

    platform: str  # "cpu", "gpu", "tpu"
    kind: str  # e.g. "NVIDIA H200"
    count: int  # local devices
    machine: str  # the host's architecture, e.g. "x86_64"
    jax: str  # JAX's version

    @classmethod
    def here(cls) -> Device:
        device = jax.local_devices()[0]
        return cls(device.platform, str(getattr(device, "device_kind", device.platform)),
                   jax.local_device_count(), platform.machine(), jax.__version__)

    @property
    def hardware(self) -> str:
        """The label of a summary (`Summary.hardware`), e.g. "gpu:NVIDIA H200 (x86_64, 1 dev)"."""
        return f"{self.platform}:{self.kind} ({self.machine}, {self.count} dev)"

    def to_json(self) -> dict[str, str]:
        """The device fields of a bench or doctor result."""
        return {"platform": self.platform, "device": self.kind, "jax": self.jax}
