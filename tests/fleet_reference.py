"""The fleet tests' hand reference for local SGD's and DaSGD's rounds under a fleet."""

import jax

from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step


def hand_averages(exp, schedule, rounds, d=0):
    """Local SGD's and DaSGD's averages under a fleet by hand, one replica and one step at a
    time, on 4 replicas: each unit's H steps; a DaSGD unit that continues goes on from its
    replica's snapshot s and after d steps takes A_base + (theta - s); a unit begun from an
    average takes its replica's optimizer state (a joiner's: the mean of the last landed
    units'); then A_j = A_{j-1} + the mean of the landed units' model minus their base.
    Local SGD's units never continue, so d does not matter for them."""
    h = exp.config.period
    step = jax.jit(make_train_step(exp.model, exp.tx))
    v = exp.variables
    averages = {0: (jax.device_get(v.params), jax.device_get(v.states))}
    opt = dict.fromkeys(range(4), init_opt_states(exp.tx, v.params))
    opt_mean, landed_last, snapshot, after = opt[0], set(), {}, {}
    streams = [exp.train_stream(exp.config.batch_size, shard_index=w, num_shards=4) for w in range(4)]

    def merge(ts, s, base):
        model = jax.tree.map(lambda a, x, y: a + (x - y), averages[base], (ts.params, ts.states), (s.params, s.states))
        return TrainState(*model, ts.opt_states)

    for j in range(1, rounds + 1):
        for u in schedule.starts[j - 1]:
            if u.dropped:
                continue
            if u.continues:
                ts = s = snapshot[u.worker]
            else:
                own = opt[u.worker] if j == 1 or u.worker in landed_last else opt_mean
                ts = TrainState(*averages[j - 1], own)
            for i in range(h):
                if u.continues and i == d:
                    ts = merge(ts, s, u.base)
                ts, _ = step(ts, *next(streams[u.worker]))
            after[u.worker] = ts
        landed = schedule.lands[j - 1]
        moved = [jax.tree.map(lambda a, b: a - b, after[u.worker][:2], averages[u.base]) for u in landed]
        mean = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]) / len(xs), *moved)
        averages[j] = jax.tree.map(lambda a, m: a + m, averages[j - 1], mean)
        if landed:
            opt_mean = jax.tree.map(
                lambda *xs: sum(xs[1:], xs[0]) / len(xs), *[after[u.worker].opt_states for u in landed]
            )
        for u in landed:
            opt[u.worker] = after[u.worker].opt_states
            snapshot[u.worker] = after[u.worker]
        landed_last = {u.worker for u in landed}
    return averages[rounds]
