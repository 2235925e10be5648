"""The explicit staleness simulator: algorithms on a virtual clock with the real kernels.

``run_simulated(exp, metrics, checkpointer)`` is what ``train --simulate`` runs (event by event,
through the ``StageExecutor``); ``plan_schedule(config)`` is what ``train --simulate
--schedule-only`` runs (the same clock without the numerics: the time to the budget, the
staleness, the devices' utilisation); ``run_fixed_staleness`` runs a known staleness schedule
as one jitted scan (the fast path), e.g. the schedule ``lags_from_log`` reads from a simulated
run's log.
"""

from pdasgd_jax.simulate.fastpath import fixed_lags, lags_from_log, run_fixed_staleness
from pdasgd_jax.simulate.run import run_simulated
from pdasgd_jax.simulate.schedule_only import SchedulePlan, plan_schedule

__all__ = ["SchedulePlan", "fixed_lags", "lags_from_log", "plan_schedule", "run_fixed_staleness", "run_simulated"]
