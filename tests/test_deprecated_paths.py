"""Modules that moved keep their old import path for one release: importing it warns with a
``DeprecationWarning`` naming the new path, and the old name is the new module itself."""

import importlib
import sys

import pytest

MOVED = {
    "pdasgd_jax.sync_runner": "pdasgd_jax.runners.sync",
    "pdasgd_jax.averaging_runner": "pdasgd_jax.runners.averaging",
    "pdasgd_jax.run_result": "pdasgd_jax.runners.result",
    "pdasgd_jax.replay_run": "pdasgd_jax.runners.replay",
    "pdasgd_jax.runtime.runner": "pdasgd_jax.runtime.lifecycle",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_the_new_module(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
