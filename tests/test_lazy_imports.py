"""What starting up loads: ``import pdasgd_jax`` and the command line's help stay light, and the
names the flags allow (``pdasgd_jax.choices``) are the ones the registries implement."""

from __future__ import annotations

import json
import subprocess
import sys

import pdasgd_jax
from pdasgd_jax import choices, data, models, optim, schedules
from pdasgd_jax.data import augment

# Loaded only when used: the study harness, plots, TFDS, checkpoints, and (for the help) JAX and Flax.
NOT_ON_IMPORT = ("benchmarks", "matplotlib", "tensorflow_datasets", "orbax", "flax", "jax")
NOT_FOR_HELP = ("flax", "jax", "pdasgd_jax.models", "pdasgd_jax.data", "pdasgd_jax.kernels")


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def _offenders(loaded: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in loaded or any(m.startswith(n + ".") for m in loaded)]


def test_importing_the_package_loads_none_of_the_heavy_or_optional_modules():
    assert _offenders(_loaded_after("import pdasgd_jax"), NOT_ON_IMPORT) == []


def test_the_help_is_built_without_jax_flax_or_the_models():
    for argv in (["--help"], ["train", "--help"], ["bench", "--help"]):
        code = f"from pdasgd_jax import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass"
        assert _offenders(_loaded_after(code), NOT_FOR_HELP) == [], argv


def test_the_public_names_resolve_on_first_use():
    assert set(pdasgd_jax.__all__) == {*pdasgd_jax._EXPORTS, "__version__"}
    for name in pdasgd_jax.__all__:
        assert getattr(pdasgd_jax, name) is not None
        assert name in dir(pdasgd_jax)
    from pdasgd_jax import StagedModel, train_and_evaluate
    from pdasgd_jax.stages import StagedModel as defined
    from pdasgd_jax.train import train_and_evaluate as trains

    assert StagedModel is defined and train_and_evaluate is trains


def test_the_flags_choices_are_the_registries_names():
    assert tuple(models.MODELS) == choices.MODEL_NAMES
    assert choices.DATASETS == data.DATASETS == tuple(data.DATASET_MODALITY)
    assert augment.AUGMENTATIONS == choices.AUGMENTATIONS
    assert optim.MERGES == choices.MERGES and optim.STALENESS_RULES == choices.STALENESS_RULES
    assert schedules.LR_SCHEDULES == choices.LR_SCHEDULES


# The code that times this machine's kernels: the simulator's clock, and a real run's delay
# given in steps of compute. A real run without delays never loads it.
KERNEL_CLOCK = ("pdasgd_jax.calibration", "pdasgd_jax.program_timing", "pdasgd_jax.simulate")


def test_a_real_run_without_delays_loads_neither_the_simulator_nor_the_kernel_clock():
    code = (
        "from pdasgd_jax import Config, train_and_evaluate\n"
        "for algo in ('sgd', 'pdasgd'):\n"
        "    train_and_evaluate(Config(algo=algo, dataset='digits', epochs=0.05, batch_size=32, progress=False))"
    )
    assert _offenders(_loaded_after(code), KERNEL_CLOCK) == []
