"""``--fleet``: devices that slow down, leave, rejoin or crash during a run, written as events at
fractions of the run's budget, or drawn from a seeded churn model; and ``FleetTimeline``, which
says for a device and a virtual time its speed factor and whether it is present.

The grammar (docs/algorithms.md, "Fleet events")::

    SPEC  := EVENT ("," EVENT)*  |  "churn:" KEY=VALUE ("," KEY=VALUE)*
    EVENT := "slow:" DEV "x" FACTOR "@" POS "-" POS      device DEV runs FACTOR times slower
           | "leave:" DEV "@" POS                        leaves (its gradient in flight counts)
           | "join:" DEV "@" POS                         (re)joins, after a state transfer
           | "crash:" DEV "@" POS                        fails (its gradient in flight is lost)

``DEV`` is a device index in ``[0, W)``, ``FACTOR`` a number ``> 1`` and ``POS`` a fraction of the
run in ``[0, 1]``. Churn keys: ``leave``, ``crash`` (per present device per run), ``join`` (per
absent device per run), ``slow=RATExFACTOR`` (slow episodes per device per run), ``slowfor``
(their mean length, a fraction of the run; default 0.05) and ``seed`` (default 0).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re

import numpy as np

PRESENCE_KINDS = ("leave", "join", "crash")
EVENT_KINDS = ("slow", *PRESENCE_KINDS)
CHURN_KEYS = ("leave", "crash", "join", "slow", "slowfor", "seed")
_GRAMMAR = (
    "slow:DEVxFACTOR@START-END, leave:DEV@POS, join:DEV@POS, crash:DEV@POS (DEV an integer, FACTOR > 1, "
    "positions fractions of the run in [0, 1]), or churn:leave=R,crash=R,join=R,slow=RxFACTOR,slowfor=F,seed=N "
    "alone"
)
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SLOW = re.compile(rf"slow:(\d+)x({_NUMBER})@({_NUMBER})-({_NUMBER})")
_PRESENCE = re.compile(rf"(leave|join|crash):(\d+)@({_NUMBER})")


class FleetError(ValueError):
    """A ``--fleet`` specification that cannot be run, naming the bad token and what is allowed."""


def _fail(token: str, why: str) -> FleetError:
    return FleetError(f"--fleet {token!r}: {why}; the grammar is {_GRAMMAR}")


@dataclasses.dataclass(frozen=True)
class SlowWindow:
    """Device ``device`` runs ``factor`` times slower from ``start`` to ``end`` (fractions of the run)."""

    device: int
    factor: float
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class PresenceEvent:
    """Device ``device`` leaves, joins or crashes (``kind``) at ``at`` (a fraction of the run)."""

    kind: str
    device: int
    at: float


@dataclasses.dataclass(frozen=True)
class Churn:
    """Rates of the seeded churn model, per device per run (see ``churn_events``)."""

    leave: float = 0.0
    crash: float = 0.0
    join: float = 0.0
    slow: float = 0.0
    slow_factor: float = 2.0
    slow_for: float = 0.05
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "slow_factor", float(self.slow_factor))


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """A parsed ``--fleet``: explicit events, or a churn model (expanded by ``events``)."""

    slow: tuple[SlowWindow, ...] = ()
    presence: tuple[PresenceEvent, ...] = ()
    churn: Churn | None = None

    @property
    def empty(self) -> bool:
        """Whether it changes nothing (no event and no churn)."""
        churns = self.churn is not None and (self.churn.leave or self.churn.crash or self.churn.slow)
        return not (self.slow or self.presence or churns)

    def events(self, num_devices: int) -> tuple[tuple[SlowWindow, ...], tuple[PresenceEvent, ...]]:
        """The slow windows and presence events on ``num_devices`` devices (the churn drawn).

        Args:
          num_devices: W.

        Returns:
          ``(slow windows, presence events)``.

        Raises:
          FleetError: an event that cannot happen on W devices, naming it.
        """
        if self.churn is not None:
            return churn_events(self.churn, num_devices)
        _check_events(self.slow, self.presence, num_devices)
        return self.slow, self.presence


def parse_fleet(text: str | None) -> FleetSpec:
    """Parses a ``--fleet`` specification (module docstring); None or ``""``: no event.

    Args:
      text: the specification.

    Returns:
      The events, checked on their own (device indices are checked by ``FleetSpec.events``).

    Raises:
      FleetError: a token that is not in the grammar, naming it and what is allowed.

    Examples:
        >>> spec = parse_fleet("slow:2x4@0.2-0.4,leave:3@0.3,join:3@0.6,crash:5@0.5")
        >>> spec.slow
        (SlowWindow(device=2, factor=4.0, start=0.2, end=0.4),)
        >>> [(e.kind, e.device, e.at) for e in spec.presence]
        [('leave', 3, 0.3), ('join', 3, 0.6), ('crash', 5, 0.5)]
        >>> parse_fleet("churn:leave=0.1,join=0.5,slow=0.2x3,seed=7").churn.slow_factor
        3.0
    """
    if not text:
        return FleetSpec()
    tokens = [t.strip() for t in str(text).split(",")]
    if tokens[0].startswith("churn:"):
        return FleetSpec(churn=_parse_churn([tokens[0][len("churn:") :], *tokens[1:]]))
    slow, presence = [], []
    for token in tokens:
        if (m := _SLOW.fullmatch(token)) is not None:
            device, factor = int(m.group(1)), float(m.group(2))
            start, end = _position(token, m.group(4)), _position(token, m.group(6))
            if not factor > 1:
                raise _fail(token, f"slow factor {factor} must be > 1")
            if not start < end:
                raise _fail(token, f"slow window {start}-{end} must start before it ends")
            slow.append(SlowWindow(device, factor, start, end))
        elif (m := _PRESENCE.fullmatch(token)) is not None:
            presence.append(PresenceEvent(m.group(1), int(m.group(2)), _position(token, m.group(3))))
        elif token.startswith("churn:") or "=" in token:
            raise _fail(token, "a churn model stands alone: give churn:... as the whole specification")
        else:
            kind = token.split(":", 1)[0]
            why = f"unknown event {kind!r}" if kind not in EVENT_KINDS else f"malformed {kind} event"
            raise _fail(token, why)
    return FleetSpec(tuple(slow), tuple(presence))


def _position(token: str, text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise _fail(token, f"position {text} is outside [0, 1] (a fraction of the run)")
    return value


def _parse_churn(items: list[str]) -> Churn:
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        token = f"churn:...{item}"
        if not sep or key not in CHURN_KEYS:
            raise _fail(token, f"unknown churn key {key!r}; the keys are {', '.join(CHURN_KEYS)}")
        if key in values or (key == "slow" and "slow_factor" in values):
            raise _fail(token, f"churn key {key} given twice")
        try:
            if key == "slow":
                rate, x, factor = value.partition("x")
                values["slow"], values["slow_factor"] = float(rate), float(factor if x else "nan")
            else:
                values[key] = float(value)
        except ValueError:
            raise _fail(token, f"churn {key}={value!r} is not a number") from None
        if key == "seed" and not (values[key].is_integer() and 0 <= values[key] < 2**32):
            raise _fail(token, f"churn seed {value} must be an integer in [0, 2**32)")
        if key == "slowfor" and not 0 < values[key] <= 1:
            raise _fail(token, f"churn slowfor {value} must be in (0, 1] (a fraction of the run)")
        if key == "slow" and not values["slow_factor"] > 1:
            raise _fail(token, f"churn slow={value} needs RATExFACTOR with FACTOR > 1")
        if not (math.isfinite(values[key]) and values[key] >= 0):
            raise _fail(token, f"churn {key}={value} must be a finite number >= 0")
    if "slowfor" in values:
        values["slow_for"] = values.pop("slowfor")
    return Churn(**{k: int(v) if k == "seed" else v for k, v in values.items()})


def _check_events(slow: tuple[SlowWindow, ...], presence: tuple[PresenceEvent, ...], num_devices: int) -> None:
    """Devices in range, one device's slow windows apart, its presence events in a possible order
    (a join of an absent device, a leave or crash of a present one, never two at one instant), and
    some device present at every instant."""
    for event in (*slow, *presence):
        if not 0 <= event.device < num_devices:
            raise _fail(_token(event), f"device {event.device} is outside [0, {num_devices}) on {num_devices} devices")
    for d in range(num_devices):
        windows = sorted((w for w in slow if w.device == d), key=lambda w: w.start)
        for a, b in itertools.pairwise(windows):
            if b.start < a.end:
                raise _fail(_token(b), f"it overlaps {_token(a)}: one device's slow windows must not overlap")
    present, seen = [True] * num_devices, {}
    for event in sorted(presence, key=lambda e: e.at):
        if (event.device, event.at) in seen:
            raise _fail(
                _token(event), f"device {event.device} has two events at {event.at}: {seen[event.device, event.at]}"
            )
        seen[event.device, event.at] = _token(event)
        joining = event.kind == "join"
        if present[event.device] == joining:
            state = "present" if joining else "absent (it left or crashed before)"
            raise _fail(_token(event), f"device {event.device} is already {state} at {event.at}")
        present[event.device] = joining
        if not any(present):
            raise _fail(_token(event), f"no device is present from {event.at} on: keep at least one")


def _token(event: SlowWindow | PresenceEvent) -> str:
    if isinstance(event, SlowWindow):
        return f"slow:{event.device}x{event.factor:g}@{event.start:g}-{event.end:g}"
    return f"{event.kind}:{event.device}@{event.at:g}"


def churn_events(churn: Churn, num_devices: int) -> tuple[tuple[SlowWindow, ...], tuple[PresenceEvent, ...]]:
    """Draws ``churn``'s events on ``num_devices`` devices, deterministically from its seed.

    Presence is one continuous-time Markov chain over the run ``[0, 1)``: each present device
    leaves at rate ``leave`` and crashes at rate ``crash``, each absent device joins at rate
    ``join`` (rates per device per run); a departure of the last present device is skipped.
    Each device's slow episodes come at rate ``slow`` one after another, each lasting an
    exponential time of mean ``slow_for`` (cut at the run's end), ``slow_factor`` times slower.

    Args:
      churn: the rates.
      num_devices: W.

    Returns:
      ``(slow windows, presence events)``, in the form ``parse_fleet`` gives explicit ones.

    Examples:
        >>> slow, presence = churn_events(Churn(leave=2.0, join=4.0, seed=7), 4)
        >>> presence == churn_events(Churn(leave=2.0, join=4.0, seed=7), 4)[1]
        True
    """
    rng = np.random.default_rng([churn.seed, num_devices])
    present, presence, t = [True] * num_devices, [], 0.0
    while True:
        rates = [(churn.leave + churn.crash) if p else churn.join for p in present]
        total = sum(rates)
        if total <= 0:
            break
        t += rng.exponential(1 / total)
        if t >= 1:
            break
        d = int(rng.choice(num_devices, p=np.asarray(rates) / total))
        kind = (
            "join"
            if not present[d]
            else ("leave" if rng.random() * (churn.leave + churn.crash) < churn.leave else "crash")
        )
        if kind != "join" and sum(present) == 1:
            continue
        present[d] = kind == "join"
        presence.append(PresenceEvent(kind, d, float(t)))
    slow = []
    for d in range(num_devices):
        t = 0.0
        while churn.slow > 0:
            t += rng.exponential(1 / churn.slow)
            if t >= 1:
                break
            end = min(1.0, t + rng.exponential(churn.slow_for))
            slow.append(SlowWindow(d, churn.slow_factor, float(t), float(end)))
            t = end
    return tuple(slow), tuple(presence)


class FleetTimeline:
    """A fleet's events on ``num_devices`` devices in virtual seconds: a position ``p`` of the
    specification is ``p * horizon`` (the virtual length of the same run without fleet events).

    Pure and deterministic: it answers ``factor``, ``present``, ``elapsed`` and ``crash_in``.

    Args:
      spec: the parsed specification.
      num_devices: W.
      horizon: virtual seconds that position 1 stands for (> 0).

    Examples:
        >>> fleet = FleetTimeline(parse_fleet("slow:1x4@0.2-0.4,leave:0@0.5,join:0@0.75"), 2, 100.0)
        >>> fleet.factor(1, 30.0), fleet.factor(1, 40.0), fleet.factor(0, 30.0)
        (4.0, 1.0, 1.0)
        >>> fleet.present(0, 49.0), fleet.present(0, 50.0), fleet.present(0, 80.0)
        (True, False, True)
        >>> fleet.elapsed(1, 10.0, 20.0)  # 10 s of work by 20 s, 5 s in the window, 5 s after it
        35.0
    """

    def __init__(self, spec: FleetSpec, num_devices: int, horizon: float):
        if not (math.isfinite(horizon) and horizon > 0):
            raise ValueError(f"fleet horizon {horizon!r} must be a finite number of seconds > 0")
        slow, presence = spec.events(num_devices)
        self.num_devices = num_devices
        self.horizon = float(horizon)
        self._windows: list[list[tuple[float, float, float]]] = [[] for _ in range(num_devices)]
        for w in sorted(slow, key=lambda w: w.start):
            end = math.inf if w.end >= 1 else w.end * horizon  # to the end of the run, however long it gets
            self._windows[w.device].append((w.start * horizon, end, w.factor))
        self._ends = [[end for _, end, _ in ws] for ws in self._windows]
        self._changes: list[list[tuple[float, str]]] = [[] for _ in range(num_devices)]
        for e in sorted(presence, key=lambda e: e.at):
            self._changes[e.device].append((e.at * horizon, e.kind))
        self._change_times = [[t for t, _ in cs] for cs in self._changes]

    @property
    def changes_presence(self) -> bool:
        """Whether any device leaves, joins or crashes."""
        return any(self._changes)

    def factor(self, device: int, t: float) -> float:
        """``device``'s slow-down factor at virtual time ``t`` (1: full speed)."""
        i = bisect.bisect_right(self._ends[device], t)
        windows = self._windows[device]
        return windows[i][2] if i < len(windows) and windows[i][0] <= t else 1.0

    def present(self, device: int, t: float) -> bool:
        """Whether ``device`` is in the fleet at ``t`` (an event at ``t`` has happened)."""
        i = bisect.bisect_right(self._change_times[device], t)
        return i == 0 or self._changes[device][i - 1][1] == "join"

    def joined_at(self, device: int, t: float) -> float | None:
        """When ``device``, present at ``t``, last joined (None: a member from the start)."""
        i = bisect.bisect_right(self._change_times[device], t)
        return self._changes[device][i - 1][0] if i and self._changes[device][i - 1][1] == "join" else None

    def join_times(self, device: int) -> tuple[float, ...]:
        """The virtual times at which ``device`` joins."""
        return tuple(t for t, kind in self._changes[device] if kind == "join")

    def crash_in(self, device: int, after: float, until: float) -> float | None:
        """The time of ``device``'s first crash in ``(after, until]``, or None."""
        i = bisect.bisect_right(self._change_times[device], after)
        for at, kind in self._changes[device][i:]:
            if at > until:
                break
            if kind == "crash":
                return at
        return None

    def elapsed(self, device: int, start: float, work: float) -> float:
        """Virtual seconds ``device`` takes for ``work`` seconds of its full-speed work begun at
        ``start``: inside a slow window work progresses at ``1 / factor``.

        Args:
          device: the device.
          start: virtual time the work begins.
          work: seconds it takes at the device's full speed.

        Returns:
          The seconds it takes; ``work`` itself, exactly, when no window overlaps it.
        """
        windows = self._windows[device]
        i = bisect.bisect_right(self._ends[device], start)
        if i == len(windows) or windows[i][0] >= start + work:
            return work
        t, remaining = start, work
        for begin, end, factor in windows[i:]:
            if t < begin:
                if remaining <= begin - t:
                    break
                remaining -= begin - t
                t = begin
            if remaining * factor <= end - t:
                return t + remaining * factor - start
            remaining -= (end - t) / factor
            t = end
        return t + remaining - start
