"""The API reference covers every public name, and every entry reads as optax's do: a summary
line, its arguments (or attributes), what it returns, and an example; the examples written as
doctests run and print what they say."""

import doctest
import importlib
import inspect
import pathlib
import re

import pytest

import pdasgd_jax
from pdasgd_jax import config, kernels, model_steps, stage_update, stages

API_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"
ENTRIES = re.findall(r"^::: (\S+)$", API_PAGE.read_text(), flags=re.M)


def _object(entry):
    module, _, name = entry.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_has_an_entry():
    documented = {entry.rpartition(".")[2] for entry in ENTRIES}
    assert set(pdasgd_jax.__all__) - {"__version__"} <= documented


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_entry_has_a_summary_its_arguments_what_it_returns_and_an_example(entry):
    obj = _object(entry)
    doc = inspect.getdoc(obj) or ""
    assert doc and doc.split("\n")[0].strip(), f"{entry} has no summary line"
    parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
    if parameters:
        assert "Args:" in doc or "Attributes:" in doc, f"{entry} does not describe {parameters}"
    returns = inspect.signature(obj).return_annotation
    if inspect.isfunction(obj) and returns not in (inspect.Signature.empty, None, "None"):
        assert "Returns:" in doc, f"{entry} does not say what it returns"
    assert "Example" in doc or ">>>" in doc, f"{entry} has no example"


@pytest.mark.parametrize("module", [stages, kernels, model_steps, stage_update, config], ids=lambda m: m.__name__)
def test_the_doctest_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
