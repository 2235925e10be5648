"""``DelayModel``: injected delays drawn from a named distribution, plus the ``straggler``
slow-down (algorithms.md §5).

An operation whose compute takes ``d`` seconds (already scaled by its worker's speed factor)
is followed by ``idle_time = d * (slowdown - 1) + share * sample`` seconds of idle time, so it
lasts ``d * slowdown + share * sample`` in all. Idle time is waiting, not device work: the
simulator frees the device during it and the real runtime sleeps through it. ``share`` is 1
but for a PD-ASGD worker under ``per="job"`` (``DelayModel.shares``), where ``sample`` is the
one draw of the job, made by its forward worker and carried with the job to its backward
worker (``DelayModel.job_idle``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import numpy as np

from pdasgd_jax.choices import DELAY_MODELS, DELAY_PER
from pdasgd_jax.delays._checks import _finite_non_negative, _require
from pdasgd_jax.delays.streams import LazyStream


@dataclasses.dataclass(frozen=True)
class DelayModel:
    """An injected-delay distribution; durations are in the unit of ``mean`` (seconds).

    ``sample`` draws additive idle delays whose expectation is ``mean``:

    * ``none``: always 0 (``mean`` must be 0);
    * ``constant``: always ``mean``;
    * ``uniform``: uniform on ``[0, 2 * mean]``;
    * ``exponential``: exponential with mean ``mean``;
    * ``lognormal``: ``exp(N(mu, sigma^2))`` with ``mu = log(mean) - sigma^2 / 2`` (heavy tail);
    * ``straggler``: a constant ``mean`` (0 by default); its randomness is ``slowdown``.

    ``slowdown`` is 1 for every model but ``straggler``, which draws ``factor`` with
    probability ``prob``. Whether a draw applies per kernel or per step is the caller's
    choice: one ``idle_time`` per operation it models.

    ``per`` says what one draw covers where a job is split over two workers (PD-ASGD's
    forward and backward, algorithms.md §5): ``operation``, each worker's part of it (two
    draws per job); ``job``, the whole job: its forward worker draws it, the job carries
    it to its backward worker, and each idles its ``shares`` of that one draw (``job_idle``).

    Example::

        model = DelayModel("lognormal", mean=0.01, sigma=1.5)
        model.sample(rng_for(0, "delay"), size=3)  # three durations, mean 0.01 s each
    """

    name: str = "none"
    mean: float = 0.0
    sigma: float = 1.0
    prob: float = 0.1
    factor: float = 3.0
    per: str = "operation"

    def __post_init__(self):
        _require(
            self.name in DELAY_MODELS, f"unknown delay model {self.name!r}; choose one of {', '.join(DELAY_MODELS)}"
        )
        _require(self.per in DELAY_PER, f"delay per {self.per!r} is not allowed; choose one of {', '.join(DELAY_PER)}")
        _finite_non_negative("delay mean", self.mean)
        _require(
            self.name != "none" or self.mean == 0, f"delay mean {self.mean!r} needs a delay model other than 'none'"
        )
        _require(math.isfinite(self.sigma) and self.sigma > 0, f"lognormal sigma {self.sigma!r} must be > 0")
        _require(0 <= self.prob <= 1, f"straggler probability {self.prob!r} is outside [0, 1]")
        _require(math.isfinite(self.factor) and self.factor >= 1, f"straggler factor {self.factor!r} must be >= 1")

    @classmethod
    def from_config(cls, config: Any, step_compute_time: float) -> DelayModel:
        """Deprecated: ``Experiment.delay_model(step_compute_time)`` builds the run's delay model;
        this reads the same fields of ``config`` and is removed in the next release."""
        warnings.warn(
            "DelayModel.from_config is deprecated; use Experiment.delay_model(step_compute_time)",
            DeprecationWarning,
            stacklevel=2,
        )
        return cls.in_steps(
            config.delay_model,
            config.delay_mean,
            step_compute_time,
            sigma=config.delay_sigma,
            prob=config.straggler_prob,
            factor=config.straggler_factor,
            per=config.delay_per,
        )

    @classmethod
    def in_steps(
        cls,
        name: str,
        mean_steps: float,
        step_compute_time: float,
        *,
        sigma: float = 1.0,
        prob: float = 0.1,
        factor: float = 3.0,
        per: str = "operation",
    ) -> DelayModel:
        """A delay model whose mean is given in multiples of one step's compute.

        Args:
          name, sigma, prob, factor, per: as the fields of the same names.
          mean_steps: the mean delay in steps of compute (``--delay-mean``).
          step_compute_time: seconds of one step's compute, usually
            ``TimingModel.step_compute_time()``.
        """
        _finite_non_negative("step compute time", step_compute_time)
        return cls(name, mean_steps * step_compute_time, sigma, prob, factor, per)

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        """Additive delays ``>= 0``: a float when ``size`` is None, else an array of that shape."""
        # size=None draws a Python float, consuming the stream as a 0-d draw would, at a
        # fraction of the cost (the runtime draws once per worker per job).
        call = self._scalar_call
        if call is not None and self.name != "straggler":
            method, args = call
            return getattr(rng, method)(*args, size)
        return float(self.mean) if size is None else np.full(size, float(self.mean))  # none, constant, straggler

    def slowdown(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        """Multiplicative slow-down: ``factor`` with probability ``prob`` for ``straggler``, else 1."""
        if self.name != "straggler":
            return 1.0 if size is None else np.ones(size)
        if size is None:
            return float(self.factor) if rng.random() < self.prob else 1.0
        return np.where(rng.random(size) < self.prob, self.factor, 1.0)

    def shares(self, forward: float, backward: float) -> tuple[float, float]:
        """The fractions of a delay draw that the forward and the backward worker of one
        PD-ASGD job idle, given the compute of their parts of it (seconds).

        ``per="operation"``: ``(1, 1)``, each worker a whole draw. ``per="job"``: the one draw
        of the job split in proportion to the compute, ``(f / (f + b), b / (f + b))``, so
        the job idles one draw in all (half each when both are free). A worker that runs a
        whole job (sync, ASGD, LPP-SGD, local SGD, DaSGD) takes share 1 under both.

        The simulator and the runtime both take ``forward`` and ``backward`` from the
        calibrated costs the clock charges the two workers (``TimingModel.pipeline_compute``),
        so they split alike.
        """
        if self.per == "operation":
            return 1.0, 1.0
        _finite_non_negative("forward compute", forward)
        _finite_non_negative("backward compute", backward)
        total = forward + backward
        if total == 0:
            return 0.5, 0.5
        return forward / total, backward / total

    def idle_time(self, rng: np.random.Generator, duration: float, share: float = 1.0) -> float:
        """Idle seconds to add after an operation whose compute took ``duration`` seconds:
        its slow-down and ``share`` (``shares``; in [0, 1]) of one delay draw of its own
        (``job_idle`` with nothing carried)."""
        return self.job_idle(rng, duration, share)[0]

    def job_idle(
        self, rng: np.random.Generator, duration: float, share: float = 1.0, carried: float | None = None
    ) -> tuple[float, float]:
        """A worker's idle seconds after its part of a job, and the job's delay draw.

        The idle time is ``duration * (slowdown - 1) + share * draw``. Every call takes the
        same two draws from ``rng``, the slow-down first, then a delay ``sample``, under both
        ``per`` semantics (so a stream is consumed alike whatever the semantics). The draw
        used is that sample, except under ``per="job"`` when the job already ``carried`` one:
        the draw its forward worker made, which its backward worker idles its share of
        instead of its own sample (one draw per job in all). The returned draw is the one
        used, for the job to carry on.

        Args:
          rng: the worker's delay stream.
          duration: its compute on the job (seconds), which the slow-down stretches.
          share: the fraction of the draw it idles (``shares``), in [0, 1].
          carried: the draw the job's previous worker returned (None: the job's first worker).
        """
        _finite_non_negative("operation duration", duration)
        if not 0 <= share <= 1:
            raise ValueError(f"delay share {share!r} is outside [0, 1]")
        if type(rng) is LazyStream:  # a simulated worker's stream: its one draw from a block
            slowdown, own = self._drawn(rng)
        else:
            slowdown, own = self.slowdown(rng), self.sample(rng)
        slowed = duration * (slowdown - 1.0)
        draw = carried if carried is not None and self.per == "job" else own
        return slowed + share * draw, draw

    @functools.cached_property
    def _scalar_call(self) -> tuple[str, tuple[float, ...]] | None:
        """The one draw ``slowdown`` and ``sample`` take from a stream between them, as the
        ``Generator`` method and its arguments before ``size`` (``LazyStream.draw``'s ``call``;
        None: they draw nothing)."""
        if self.name == "straggler":
            return "random", ()
        if not self.mean:
            return None
        if self.name == "uniform":
            return "uniform", (0.0, 2.0 * self.mean)
        if self.name == "exponential":
            return "exponential", (self.mean,)
        if self.name == "lognormal":
            return "lognormal", (math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        return None  # constant

    def _drawn(self, rng: LazyStream) -> tuple[float, float]:
        """``(slowdown(rng), sample(rng))``, bitwise, their draw taken with ``LazyStream.draw``."""
        call = self._scalar_call
        if call is None:
            return 1.0, float(self.mean)
        value = rng.draw(call)
        if self.name == "straggler":
            return (float(self.factor) if value < self.prob else 1.0), float(self.mean)
        return 1.0, value
