"""Steps and slots of a compiled plan (``schedule_plan``, ``live_plan``): the steps still free
for an operation, and slots for values that live from one step to a later one."""

from __future__ import annotations

import heapq

import numpy as np


class FreeSteps:
    """The steps not yet booked for one kind of operation (at most one per step: a
    job's gradient, or its forward, or a stage's backward)."""

    def __init__(self):
        self._next: dict[int, int] = {}  # a booked step -> a later step to look at next

    def first(self, step: int) -> int:
        """The first free step at or after ``step``."""
        path = []
        while step in self._next:
            path.append(step)
            step = self._next[step]
        for booked in path:  # every step from it up to ``step`` is booked
            self._next[booked] = step
        return step

    def take(self, step: int) -> int:
        """Books the first free step at or after ``step``."""
        step = self.first(step)
        self._next[step] = step + 1
        return step

    def book(self, release: int, deadline: int) -> int:
        """Books the latest free step in ``[release, deadline]`` (earlier ones stay free for
        gradients needed sooner), else the first free one after it."""
        step = self.first(release)
        if step <= deadline:
            step = next(s for s in range(deadline, step - 1, -1) if s not in self._next)
        self._next[step] = step + 1
        return step


def interval_slots(steps: np.ndarray, last_use: np.ndarray) -> tuple[np.ndarray, int]:
    """A slot per value written at ``steps`` such that none is written while an earlier one
    in it is still used (up to its ``last_use`` step, inclusive), and the number of slots."""
    slots, free, busy = np.zeros(len(steps), np.int32), [], []
    count = 0
    for i in np.argsort(steps, kind="stable"):
        while busy and busy[0][0] < steps[i]:
            heapq.heappush(free, heapq.heappop(busy)[1])
        slot = heapq.heappop(free) if free else count
        count = max(count, slot + 1)
        slots[i] = slot
        heapq.heappush(busy, (int(last_use[i]), slot))
    return slots, max(count, 1)
