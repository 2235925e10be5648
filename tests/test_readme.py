"""The README's Python blocks run exactly as written (no hidden setup)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# Blocks that need names the reader supplies (a loss function of their own) are fragments.
RUNNABLE = [block for block in BLOCKS if "loss_fn" not in block]


def test_the_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 2
    # The own-model example (your modules, optimizer and arrays; PD-ASGD simulated and threaded, DaSGD) is run.
    assert any("dataset=data" in block and "update_modules(" in block for block in RUNNABLE)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.splitlines()[0][:40] for b in RUNNABLE])
def test_a_readme_block_runs_as_written(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(0.5 < float(line.split()[0]) <= 1.0 for line in lines)  # each line: a test accuracy first


COMMANDS = [
    line.split("-m pdasgd_jax", 1)[1].split("#", 1)[0].split()
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    for line in block.replace("\\\n", " ").splitlines()
    if "-m pdasgd_jax" in line
]


def test_the_readme_commands_are_valid_as_written():
    """Every ``python -m pdasgd_jax`` command of the README parses, and each ``train`` command's
    flags pass the checks made before any work (running them is the quick start's and the
    wheel check's job; these only must not have gone stale)."""
    from pdasgd_jax.cli import config_from_args, parse_args

    assert len(COMMANDS) >= 5 and any(argv[0] == "train" for argv in COMMANDS)
    for argv in COMMANDS:
        args = parse_args(argv)
        if args.command == "train" and not args.resume:
            config_from_args(args).validate()
