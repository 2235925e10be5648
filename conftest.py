"""Test setup: 8 fake CPU devices for the multi-device paths (must precede JAX's start), and one
compilation cache for the test run (shared by pytest-xdist's workers)."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # after the flags above

# Many tests build the same tiny experiment afresh, each with its own jitted kernels, and XLA's
# compiling is most of their time on CPU: a compilation cache shared by the session compiles each
# program once and loads it after (about 40 % less CPU time over test_simulate, test_train and
# test_checkpoint). A new temporary directory per session, removed at exit, so no run reads an
# earlier run's programs; set through jax.config, not the environment, so subprocesses (the CLI's,
# the notebooks' kernels, the multi-host processes) keep their own compiling.
# pytest-xdist's workers, started after this runs in their controller, inherit its folder's name
# (``_SHARED_CACHE``) and share the folder, which the controller removes at its exit.
_SHARED_CACHE = "PDASGD_TESTS_XLA_CACHE"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = os.environ.get(_SHARED_CACHE)
    if _cache_dir is None:
        _cache_dir = os.environ[_SHARED_CACHE] = tempfile.mkdtemp(prefix="pdasgd-tests-xla-cache-")
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_configure(config):
    # The cache writes its files without a lock: a thread reading an entry another thread is
    # still writing gets a warning and compiles the program itself, which is no failure.
    for message in ("Error reading persistent compilation cache entry", "Error writing persistent compilation cache"):
        config.addinivalue_line("filterwarnings", f"ignore:{message}:UserWarning")
