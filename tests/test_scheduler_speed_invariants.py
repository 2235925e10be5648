"""What the scheduler's faster paths rely on: the current instant's events run in (phase,
order scheduled) order whether they waited in the heap or were scheduled at that instant; a
``Countdown`` resumes its worker exactly where a channel of ``n`` items would; a zero-length
``Sleep`` with a read at its start resumes its worker where its wake-up event would have; a
lazy delay stream draws bitwise what its generator draws, also once its methods are kept,
also when its seed was derived with its family's, and also when its draws are taken in
blocks (``LazyStream.draw``), whatever else uses its generator between them."""

import random

import numpy as np
import pytest

from pdasgd_jax.delays import DelayModel, rng_for
from pdasgd_jax.delays import streams as streams_module
from pdasgd_jax.delays.streams import LazyStream, StreamFamily
from pdasgd_jax.simulate.scheduler import AVERAGE, END, START, Channel, Countdown, Get, Put, Scheduler, Sleep


def test_an_instants_events_run_by_phase_then_in_the_order_scheduled():
    sched, order = Scheduler(), []

    def note(tag):
        order.append((tag, sched.now))

    def first_write():
        note("e1")
        assert not sched.alone_at_now()
        sched.call(START, note, "s2")
        sched.call(END, note, "e2")
        sched.call(AVERAGE, note, "a2")
        sched.call_at(1.0, END, note, "e3")  # at the current instant: behind e2
        sched.call_at(1.5, END, note, "later")

    sched.call_at(1.0, START, note, "s1")
    sched.call_at(1.0, END, first_write)
    sched.call_at(1.0, AVERAGE, note, "a1")
    sched.call_at(0.5, START, note, "early")
    assert sched.run() == 1.5
    tags = [tag for tag, _ in order]
    assert tags == ["early", "e1", "e2", "e3", "a1", "a2", "s1", "s2", "later"]
    assert [t for _, t in order] == [0.5] + [1.0] * 7 + [1.5]
    assert sched.alone_at_now()


def _trace(mode: str, seed: int, n: int = 3) -> list:
    """Who did what when: a worker waiting for ``n`` arrivals (a ``Countdown``, or ``n``
    ``Get``s of a channel the arrivals ``Put`` to), arrivals and bystanders at tied instants."""
    draw = random.Random(seed)
    starts = [draw.choice((0.0, 1.0, 2.0)) for _ in range(2 * n + 1)]
    sched, log = Scheduler(), []
    latch, channel, signal = Countdown(n, sched), Channel(n), Channel(n)

    def waiter():
        yield Sleep(starts[0])
        log.append(("waits", sched.now))
        if mode == "countdown":
            yield latch
        else:
            for _ in range(n):
                yield Get(channel)
        log.append(("resumed", sched.now))

    def arrival(i):
        yield Sleep(starts[1 + i])
        log.append(("arrives", i, sched.now))
        if mode == "countdown":
            latch.arrive()
        else:
            yield Put(channel, i)
        yield Put(signal, i)  # wakes a bystander: an event queued right behind the arrival's
        yield Sleep(0.0, lambda: log.append(("reads", i, sched.now)))
        log.append(("after read", i, sched.now))

    def bystander(k):
        yield Sleep(starts[1 + n + k])
        log.append(("bystander", k, sched.now))
        yield Get(signal)
        log.append(("bystander signalled", k, sched.now))

    sched.spawn("waiter", waiter())
    for i in range(n):
        sched.spawn(f"arrival{i}", arrival(i))
        sched.spawn(f"bystander{i}", bystander(i))
    sched.run()
    return log


@pytest.mark.parametrize("seed", range(40))
def test_a_countdown_resumes_its_worker_where_a_channel_would(seed):
    channel = _trace("channel", seed)
    last = max(e[-1] for e in channel if e[0] in ("waits", "arrives"))
    assert [e for e in channel if e[0] == "resumed"] == [("resumed", last)]
    assert _trace("countdown", seed) == channel


def test_a_countdown_already_done_does_not_wait():
    sched, log = Scheduler(), []
    latch = Countdown(2, sched)

    def worker():
        latch.arrive()
        latch.arrive()
        yield latch
        log.append(sched.now)

    sched.spawn("w", worker())
    sched.run()
    assert log == [0.0] and latch.waiter is None


def test_a_read_at_a_zero_sleeps_start_resumes_where_its_wake_up_would():
    """The wake-up of a zero-length sleep with a read is run at once only when it would be the
    next event: after the read, with no write queued at this instant."""
    sched, log = Scheduler(), []

    def reader():
        yield Sleep(0.0, lambda: (log.append("read"), sched.call(END, log.append, "write queued by the read")))
        log.append("reader resumed")
        yield Sleep(0.0, lambda: log.append("second read"))
        log.append("reader resumed again")

    def other():
        yield Sleep(0.0, lambda: log.append("other read"))
        log.append("other resumed")

    sched.spawn("reader", reader())
    sched.spawn("other", other())
    sched.run()
    assert log == [
        "read",
        "write queued by the read",  # a write queued by the read runs before its wake-up
        "reader resumed",
        "other read",
        "other resumed",  # nothing queued: resumed at once, where its wake-up would run
        "second read",
        "reader resumed again",
    ]


def test_a_lazy_stream_keeps_drawing_bitwise_its_generators_draws():
    lazy, eager = LazyStream(7, "delay", "w3"), rng_for(7, "delay", "w3")
    drawn = [lazy.exponential(2.0) for _ in range(3)]
    assert "exponential" in vars(lazy)  # kept: later draws skip ``__getattr__``
    drawn += [lazy.exponential(2.0), lazy.random()]
    assert drawn == [*(eager.exponential(2.0) for _ in range(4)), eager.random()]


@pytest.mark.parametrize("seed", [0, 5, 2**40, 2**140])
def test_a_stream_familys_streams_draw_bitwise_what_rng_for_draws(seed):
    family = StreamFamily(seed, "delay")
    names = [f"d{g}/backward{g % 2}" for g in range(30)] + [0, 7, 2**40, 2**70]
    streams = [family.stream(name) for name in names]
    trigger = family.stream("trigger")
    assert trigger.exponential(1.0) == rng_for(seed, "delay", "trigger").exponential(1.0)
    assert all(stream._state is not None for stream in streams)  # derived at the first draw of any
    late = family.stream("d99/forward0")  # made after: derived at its own first draw
    assert late.random() == rng_for(seed, "delay", "d99/forward0").random()
    for name, stream in zip(names, streams, strict=True):
        assert stream.random(3).tobytes() == rng_for(seed, "delay", name).random(3).tobytes()


def test_a_stream_family_whose_hashing_disagrees_with_numpys_seeds_each_stream_alone(monkeypatch):
    monkeypatch.setattr(streams_module, "_seed_states", lambda seed, keys: np.zeros((len(keys), 4), np.uint64))
    family = StreamFamily(3, "delay")
    streams = [family.stream(f"w{i}") for i in range(4)]
    assert [s.random() for s in streams] == [rng_for(3, "delay", f"w{i}").random() for i in range(4)]
    assert all(s._state is None for s in streams)


# Each delay model's one scalar draw (``DelayModel._scalar_call``), as ``LazyStream.draw`` takes it.
DRAWS = [("exponential", (0.37,)), ("uniform", (0.0, 0.74)), ("lognormal", (-1.3, 1.5)), ("random", ())]


@pytest.mark.parametrize("method, args", DRAWS)
def test_a_block_of_draws_is_the_scalar_draws_and_leaves_the_generator_alike(method, args):
    """What ``LazyStream.draw`` relies on: ``method(*args, size=n)`` draws the values of ``n``
    scalar calls, in order, and leaves the generator in their state."""
    for seed in range(5):
        scalar, block = rng_for(seed, "delay", "w0"), rng_for(seed, "delay", "w0")
        one_by_one = [getattr(scalar, method)(*args) for _ in range(200)]
        blocks = [getattr(block, method)(*args, n) for n in (1, 8, 64, 127)]
        assert [float(x) for x in np.concatenate(blocks)] == one_by_one
        assert block.bit_generator.state == scalar.bit_generator.state


@pytest.mark.parametrize("method, args", DRAWS)
def test_a_lazy_streams_block_draws_are_its_scalar_draws_whatever_comes_between(method, args):
    lazy, eager = LazyStream(11, "delay", "d2/backward0"), rng_for(11, "delay", "d2/backward0")
    other = ("exponential", (2.0,)) if method != "exponential" else ("random", ())
    drawn, expected = [], []
    for step in range(300):
        if step % 97 == 5:  # the generator used directly, mid-block: the block's rest is given back
            drawn.append(lazy.normal(0.0, 1.0))
            expected.append(eager.normal(0.0, 1.0))
        elif step % 53 == 7:  # another call through ``draw``
            drawn.append(lazy.draw(other))
            expected.append(getattr(eager, other[0])(*other[1]))
        else:
            drawn.append(lazy.draw((method, args)))  # equal, not the same object: still one block
            expected.append(getattr(eager, method)(*args))
    assert drawn == expected and all(type(x) is float for x in drawn)
    assert lazy.generator.bit_generator.state == eager.bit_generator.state  # given back at the end too


@pytest.mark.parametrize(
    "model",
    [
        DelayModel("exponential", 0.3),
        DelayModel("uniform", 0.2, per="job"),
        DelayModel("lognormal", 0.3, sigma=1.5),
        DelayModel("straggler", 0.1, prob=0.3, factor=2.0),
        DelayModel("constant", 0.2),
        DelayModel("exponential", 0.0),
        DelayModel(),
    ],
)
def test_a_simulated_workers_delays_are_those_its_generator_draws(model):
    """``DelayModel.job_idle`` on a ``LazyStream`` (a simulated worker's) takes its draw from a
    block: bitwise the idle times and draws of the same calls on ``rng_for``'s generator."""
    lazy, eager = LazyStream(4, "delay", "d0/forward0"), rng_for(4, "delay", "d0/forward0")
    carried = [None, 0.25]
    got = [model.job_idle(lazy, 0.5 + i / 7, (i % 3) / 2, carried[i % 2]) for i in range(150)]
    want = [model.job_idle(eager, 0.5 + i / 7, (i % 3) / 2, carried[i % 2]) for i in range(150)]
    assert got == want
    assert lazy.generator.bit_generator.state == eager.bit_generator.state
