"""Where an asynchronous run's work happens: the one rule the simulator and the runtime share.

Worker group ``g`` (an ASGD worker, a PD-ASGD replica of F forward and B backward workers)
runs on device ``g % D``; stage ``m`` lives on device ``m % D``, its *home*: the store keeps
its parameters and optimizer state there and every update of the stage runs there, one at
a time (``replication="shared"``, algorithms.md §3). A worker on another device pulls the
stage before reading it and pushes its gradient there: one transfer each way.

Example::

    p = Placement(devices=2, groups=4, stages=3)
    p.group_device(3), p.stage_home(2), p.is_remote(stage=1, device=0)  # (1, 0, True)
"""

from __future__ import annotations

from typing import NamedTuple


class Placement(NamedTuple):
    """``devices`` devices, ``groups`` worker groups, ``stages`` model stages."""

    devices: int
    groups: int
    stages: int

    def group_device(self, group: int) -> int:
        """The device worker group ``group`` runs on (round-robin)."""
        return group % self.devices

    def stage_home(self, stage: int) -> int:
        """The device that holds stage ``stage`` and runs its updates (round-robin)."""
        return stage % self.devices

    def is_remote(self, stage: int, device: int) -> bool:
        """Whether a worker on ``device`` must pull and push stage ``stage`` over the network."""
        return self.stage_home(stage) != device

    def validate(self) -> None:
        """Raises ValueError when a count is below one or a device would be left idle."""
        for name, value in self._asdict().items():
            if value < 1:
                raise ValueError(f"placement needs {name} >= 1, got {value}")
        if self.groups < self.devices:
            raise ValueError(
                f"{self.groups} worker groups leave some of the {self.devices} devices idle; "
                f"use at least one group per device"
            )
