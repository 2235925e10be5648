"""Where an asynchronous run's work happens: the one rule the simulator and the runtime share.

Worker group ``g`` (an ASGD worker, a PD-ASGD replica of F forward and B backward workers)
runs on device ``g % D``. Stage ``m`` lives on its *home*: the store keeps its parameters and
optimizer state there and every update of the stage runs there, one at a time
(``replication="shared"``, algorithms.md §3). A worker on another device pulls the stage
before reading it and pushes its gradient there: one transfer each way.

Homes go round-robin over the *fastest* devices, those of the smallest persistent slow-down
factor (``device_factors``; ``--straggler-devices``): stage ``m`` lives on the ``m % K``-th of
those ``K`` devices. A real system would not put a shared stage on a device it knows to be
slow, where every update of the stage, whoever pushed it, would wait for that device. With
every device at the same speed (no stragglers) this is ``m % D``. Straggling devices still
run their worker groups.

Example::

    p = Placement(devices=2, groups=4, stages=3)
    p.group_device(3), p.stage_home(2), p.is_remote(stage=1, device=0)  # (1, 0, True)
    Placement(devices=4, groups=4, stages=4, device_factors=(1.0, 1.0, 1.0, 3.0)).homes()  # (0, 1, 2, 0)
"""

from __future__ import annotations

import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class Placement:
    """``devices`` devices, ``groups`` worker groups, ``stages`` model stages.

    ``device_factors[d]`` is device ``d``'s persistent slow-down (1: full speed, 3: three times
    slower; a device past the end of the tuple has factor 1): stage homes avoid the devices
    slower than the fastest.

    Frozen, so the home devices are found once per placement (a scan of every device's
    factor) and every later ``stage_home`` or ``is_remote`` is a look-up.
    """

    devices: int
    groups: int
    stages: int
    device_factors: tuple[float, ...] = ()

    def group_device(self, group: int) -> int:
        """The device worker group ``group`` runs on (round-robin over every device)."""
        return group % self.devices

    def group_slot(self, group: int) -> int:
        """Worker group ``group``'s index among the groups of its device (0 for the first)."""
        return group // self.devices

    def device_groups(self, device: int) -> range:
        """The worker groups on ``device``, in start order (``device``, ``device + D``, ...)."""
        return range(device, self.groups, self.devices)

    def device_factor(self, device: int) -> float:
        """Device ``device``'s persistent slow-down (1 when ``device_factors`` does not list it)."""
        return self.device_factors[device] if device < len(self.device_factors) else 1.0

    def home_devices(self) -> tuple[int, ...]:
        """The devices that hold stages: those of the smallest slow-down factor, in index order."""
        return self._home_devices

    @functools.cached_property
    def _home_devices(self) -> tuple[int, ...]:
        factors = [self.device_factor(d) for d in range(self.devices)]
        fastest = min(factors)
        return tuple(d for d, f in enumerate(factors) if f == fastest)

    def stage_home(self, stage: int) -> int:
        """The device that holds stage ``stage`` and runs its updates (round-robin over ``home_devices``)."""
        homes = self.home_devices()
        return homes[stage % len(homes)]

    def homes(self) -> tuple[int, ...]:
        """Every stage's home device, stage 0 first."""
        homes = self.home_devices()
        return tuple(homes[m % len(homes)] for m in range(self.stages))

    def is_remote(self, stage: int, device: int) -> bool:
        """Whether a worker on ``device`` must pull and push stage ``stage`` over the network."""
        return self.stage_home(stage) != device

    def validate(self) -> None:
        """Raises ValueError when a count is below one, a device would be left idle or a factor
        is not a finite number > 0 (or lists more devices than there are)."""
        for name in ("devices", "groups", "stages"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"placement needs {name} >= 1, got {value}")
        if self.groups < self.devices:
            raise ValueError(
                f"{self.groups} worker groups leave some of the {self.devices} devices idle; "
                f"use at least one group per device"
            )
        if len(self.device_factors) > self.devices:
            raise ValueError(f"{len(self.device_factors)} device factors for {self.devices} devices")
        for d, factor in enumerate(self.device_factors):
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(f"device factor {factor!r} of device {d} must be a finite number > 0")
