"""``--fleet``: the grammar, its checks, the churn model and ``FleetTimeline``'s answers."""

import pytest

from pdasgd_jax.config import Config
from pdasgd_jax.delays.fleet import (
    Churn,
    FleetError,
    FleetTimeline,
    PresenceEvent,
    SlowWindow,
    churn_events,
    parse_fleet,
)
from pdasgd_jax.errors import ConfigError


def test_the_issues_example_parses_into_its_events():
    spec = parse_fleet("slow:2x4@0.2-0.4,leave:3@0.3,join:3@0.6,crash:5@0.5")
    assert spec.slow == (SlowWindow(2, 4.0, 0.2, 0.4),)
    assert spec.presence == (
        PresenceEvent("leave", 3, 0.3),
        PresenceEvent("join", 3, 0.6),
        PresenceEvent("crash", 5, 0.5),
    )
    assert spec.events(6) == (spec.slow, spec.presence)
    assert parse_fleet(None).empty and parse_fleet("").empty and not spec.empty


@pytest.mark.parametrize(
    ("text", "devices", "message"),
    [
        ("slow:2x4@0.2", 4, r"'slow:2x4@0.2': malformed slow event"),
        ("fast:1@0.2", 4, r"'fast:1@0.2': unknown event 'fast'"),
        ("slow:1x1@0.1-0.2", 4, "slow factor 1.0 must be > 1"),
        ("slow:1x2@0.4-0.2", 4, "must start before it ends"),
        ("leave:1@1.5", 4, r"position 1.5 is outside \[0, 1\]"),
        ("crash:5@0.5", 4, r"'crash:5@0.5': device 5 is outside \[0, 4\) on 4 devices"),
        ("slow:0x2@0.1-0.3,slow:0x3@0.2-0.4", 4, "'slow:0x3@0.2-0.4': it overlaps slow:0x2@0.1-0.3"),
        ("join:1@0.5", 4, "'join:1@0.5': device 1 is already present at 0.5"),
        ("crash:1@0.2,leave:1@0.5", 4, "'leave:1@0.5': device 1 is already absent"),
        ("leave:1@0.5,join:1@0.5", 4, "device 1 has two events at 0.5"),
        ("leave:0@0.2,leave:1@0.3", 2, "no device is present from 0.3 on"),
        ("leave:1@0.2,churn:leave=1", 4, "a churn model stands alone"),
        ("churn:leave=1,often=2", 4, "unknown churn key 'often'; the keys are leave, crash, join"),
        ("churn:slow=0.2", 4, "needs RATExFACTOR with FACTOR > 1"),
        ("churn:leave=-1", 4, "must be a finite number >= 0"),
        ("churn:seed=1.5", 4, "churn seed 1.5 must be an integer"),
    ],
)
def test_a_bad_specification_names_its_token_and_the_grammar(text, devices, message):
    with pytest.raises(FleetError, match=message) as caught:
        parse_fleet(text).events(devices)
    assert "the grammar is slow:DEVxFACTOR@START-END" in str(caught.value)


def test_the_timeline_answers_speed_and_presence_in_virtual_seconds():
    fleet = FleetTimeline(parse_fleet("slow:1x4@0.2-0.4,leave:0@0.5,join:0@0.75,crash:1@0.9"), 2, 100.0)
    assert [fleet.factor(1, t) for t in (0.0, 19.9, 20.0, 39.9, 40.0)] == [1.0, 1.0, 4.0, 4.0, 1.0]
    assert [fleet.present(0, t) for t in (0.0, 49.9, 50.0, 74.9, 75.0)] == [True, True, False, False, True]
    assert fleet.joined_at(0, 80.0) == 75.0 and fleet.joined_at(0, 10.0) is None
    assert fleet.crash_in(1, 80.0, 95.0) == 90.0 and fleet.crash_in(1, 90.0, 95.0) is None
    assert not fleet.present(1, 90.0) and fleet.changes_presence


def test_work_inside_a_slow_window_takes_the_factor_longer_and_outside_the_same():
    fleet = FleetTimeline(parse_fleet("slow:0x4@0.2-0.4"), 1, 100.0)
    assert fleet.elapsed(0, 0.0, 0.3) == 0.3  # before the window: exactly the work
    assert fleet.elapsed(0, 40.0, 0.3) == 0.3  # after it
    assert fleet.elapsed(0, 25.0, 2.5) == pytest.approx(10.0)  # inside: 4x
    assert fleet.elapsed(0, 18.0, 3.0) == pytest.approx(2.0 + 4.0)  # 2 s before it, 1 s of work inside
    assert fleet.elapsed(0, 38.0, 1.0) == pytest.approx(2.0 + 0.5)  # 0.5 s of work inside, 0.5 s after


def test_the_churn_is_deterministic_from_its_seed_and_always_possible():
    churn = Churn(leave=3.0, crash=1.0, join=4.0, slow=2.0, slow_factor=3.0, slow_for=0.1, seed=7)
    slow, presence = churn_events(churn, 4)
    assert (slow, presence) == churn_events(churn, 4)
    assert (slow, presence) != churn_events(Churn(**{**churn.__dict__, "seed": 8}), 4)
    assert {e.kind for e in presence} == {"leave", "crash", "join"} and slow
    assert all(w.factor == 3.0 and 0 <= w.start < w.end <= 1 for w in slow)
    # Each device's windows are apart and its presence events alternate, with a device always present.
    FleetTimeline(parse_fleet("churn:leave=3,crash=1,join=4,slow=2x3,slowfor=0.1,seed=7"), 4, 1.0)
    assert churn_events(Churn(seed=7), 4) == ((), ())


def test_the_flags_are_taken_where_implemented_and_refused_elsewhere_by_name():
    Config(algo="sync", simulate=True, devices=4, fleet="slow:1x3@0.1-0.5", quorum=3, deadline="adaptive").validate()
    Config(algo="local", simulate=True, replicas=4, fleet="slow:1x3@0.1-0.5", quorum=3).validate()
    for algo in ("pdasgd", "pdasgd-block", "asgd", "dasgd", "lpp", "async-local"):
        Config(algo=algo, simulate=True, devices=2, replicas=2, fleet="slow:0x3@0.1-0.5").validate()
    with pytest.raises(ConfigError, match="not implemented for --algo sgd --simulate; implemented so far"):
        Config(algo="sgd", simulate=True, fleet="slow:0x3@0.1-0.5").validate()
    for algo in ("asgd", "lpp"):
        with pytest.raises(ConfigError, match=f"not implemented for --algo {algo} on threads; implemented so far"):
            Config(algo=algo, devices=2, replicas=2, fleet="crash:1@0.5").validate()
    # Sync on threads takes the given events, not churn (drawn on the virtual clock), and says so.
    Config(algo="sync", devices=4, fleet="leave:1@0.5").validate()
    with pytest.raises(ConfigError, match=r"--algo sync on threads takes slow, leave, crash and join .* not churn"):
        Config(algo="sync", devices=4, fleet="churn:leave=1").validate()


@pytest.mark.parametrize(
    ("fleet", "message"), [("crash:4@0.5", r"device 4 is outside \[0, 4\)"), ("slowly:1@0.5", "unknown event 'slowly'")]
)
def test_a_bad_fleet_is_refused_at_the_edge_naming_the_token(fleet, message):
    with pytest.raises(ConfigError, match=message):
        Config(algo="sync", simulate=True, devices=4, batch_size=64, progress=False, fleet=fleet).validate()
