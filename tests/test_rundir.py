"""Run directories: --out checks before any work, a lock per directory, overwrite clears only our files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdasgd_jax import rundir
from pdasgd_jax.errors import ConfigError


def test_check_out_refuses_files_runs_and_foreign_directories(tmp_path):
    rundir.check_out(str(tmp_path / "new" / "deeper"), resume=False, overwrite=False)  # will be created
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        rundir.check_out(str(a_file), resume=False, overwrite=False)
    run = tmp_path / "run"
    run.mkdir()
    rundir.check_out(str(run), resume=False, overwrite=False)  # empty: fine
    (run / rundir.METRICS_FILE).write_text("")
    with pytest.raises(ConfigError, match="already holds a run; continue it with --resume"):
        rundir.check_out(str(run), resume=False, overwrite=False)
    rundir.check_out(str(run), resume=False, overwrite=True)
    rundir.check_out(str(run), resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="exclude each other"):
        rundir.check_out(str(run), resume=True, overwrite=True)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"did not write \(notes.txt\)"):
        rundir.check_out(str(run), resume=False, overwrite=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_check_out_refuses_a_read_only_place(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot be written"):
            rundir.check_out(str(tmp_path / "run"), resume=False, overwrite=False)
    finally:
        tmp_path.chmod(0o700)


def test_clear_run_deletes_only_what_the_library_wrote(tmp_path):
    for name in (rundir.CONFIG_FILE, rundir.METRICS_FILE, rundir.STALENESS_PLOT, rundir.TIMING_FILE):
        (tmp_path / name).write_text("{}")
    (tmp_path / rundir.CHECKPOINT_DIR / "7").mkdir(parents=True)
    (tmp_path / "keep.txt").write_text("not ours")
    rundir.clear_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path):
    held = rf"in use by process {os.getpid()} on "
    with rundir.RunDirLock(str(tmp_path)), pytest.raises(ConfigError, match=held):
        rundir.RunDirLock(str(tmp_path)).__enter__()
    with rundir.RunDirLock(str(tmp_path)):  # released on exit
        pass


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pdasgd_jax.rundir import RunDirLock\n"
            f"with RunDirLock({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by process {holder.pid} "):
            rundir.RunDirLock(str(tmp_path)).__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            with rundir.RunDirLock(str(tmp_path)):
                break
        except ConfigError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
