"""--fleet crash:G@POS on threads for replicated PD-ASGD (--replication replicas): device G's group
stops, its unfinished jobs are dropped and counted, the rounds average the groups still up and
the run completes; what it cannot take is refused by name."""

import math
import re

import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment

RUN = dict(
    algo="pdasgd",
    replication="replicas",
    devices=3,
    replicas=3,
    period=4,
    delay_steps=2,
    epochs=2,
    seed=3,
    model="mlp",
    progress=False,
)


def test_a_group_that_crashes_mid_run_drops_only_its_unfinished_jobs(tmp_path):
    config = Config(**RUN, fleet="crash:1@0.5", out=str(tmp_path))
    result = train_and_evaluate(config)
    budget = Experiment.from_config(config).total_examples
    batches = math.ceil(budget / config.batch_size)
    (crash,) = result["crashes"]
    assert crash["group"] == 1 and result["crashed_groups"] == [1]
    # It crashed at the take that brought the examples taken to half the budget.
    assert crash["at"] == math.ceil(0.5 * budget / config.batch_size) * config.batch_size
    # Every batch of the budget was taken once and is applied or dropped, never both: the
    # crashed group's jobs booked before the crash stay, the others go on to the end.
    per_group = result["jobs_per_group"]
    assert per_group[1] == crash["applied_jobs"]
    assert crash["taken_jobs"] == crash["applied_jobs"] + crash["dropped_jobs"]
    assert crash["applied_jobs"] > 0 and crash["dropped_jobs"] >= 0
    assert result["steps"] == sum(per_group) and result["steps"] + crash["dropped_jobs"] == batches
    # The rounds went on over the groups still up, past the last one the crashed group merged.
    merged_by_crashed = (crash["applied_jobs"] - config.delay_steps) // config.period + 1
    assert result["averaging_rounds"] > merged_by_crashed


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(replication="shared"), "--replication shared"),
        (dict(fleet="churn:crash=0.5"), "not churn"),
        (dict(merge="eager"), "--merge eager"),
        (dict(event_log=True, out="unused"), "--event-log"),
        (dict(fleet="crash:3@0.5"), "crash:3@0.5"),
    ],
)
def test_what_a_threaded_crash_cannot_take_is_refused_by_name(changes, named):
    config = {**RUN, "fleet": "crash:1@0.4", **changes}
    with pytest.raises(ConfigError, match=re.escape(named)):
        Config(**config).validate()


def test_other_threaded_algorithms_refuse_a_fleet():
    with pytest.raises(ConfigError, match="not implemented for --algo asgd on threads"):
        Config(**{**RUN, "algo": "asgd", "fleet": "crash:1@0.4"}).validate()
