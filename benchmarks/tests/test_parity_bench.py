"""``bench parity``'s protocol: which config each row runs (training faked out)."""

import pytest

from benchmarks import parity


def test_every_row_runs_the_dataset_rate_and_scaled_rows_their_multiple(monkeypatch):
    seen: dict[str, list] = {}

    def fake_accuracy(config):
        seen.setdefault(config.algo, []).append(config)
        return 0.5

    monkeypatch.setattr(parity, "final_accuracy", fake_accuracy)
    results, table = parity.run("unused", quick=True)
    lr = parity.DATASETS["digits"]["lr"]
    for label in parity.ALGORITHMS:
        assert f"| {label} |" in table
        assert results["digits"][label]["mean"] == pytest.approx(0.5)
    rates = {c.lr for c in seen["pdasgd"] if c.replication == "replicas"}
    assert rates == {lr, lr * parity.WORKERS}
    assert {c.lr for c in seen["sgd"]} == {lr}
