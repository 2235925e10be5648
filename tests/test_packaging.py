"""The version floors and pins agree: ``pyproject.toml`` states each core dependency's floor,
``requirements-floor.txt`` pins exactly those floors (``make floors`` tests them), and
``requirements.txt`` (what ``make test`` runs) lies inside every range."""

from __future__ import annotations

import pathlib
import sys
import tomllib

from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{name}: {line} is not a pin"
            pins[requirement.name.lower()] = spec.version
    return pins


def _ranges() -> list[Requirement]:
    extras = [r for group in PROJECT["optional-dependencies"].values() for r in group]
    return [r for r in map(Requirement, PROJECT["dependencies"] + extras) if r.name != PROJECT["name"]]


def test_the_floor_file_pins_every_core_floor_and_nothing_looser():
    floors = _pins("requirements-floor.txt")
    for requirement in map(Requirement, PROJECT["dependencies"]):
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        if lower:
            assert floors.get(requirement.name.lower()) == lower[0], f"{requirement} vs requirements-floor.txt"
    assert floors["jaxlib"] == floors["jax"]  # jax pins its own jaxlib


def test_the_tested_pins_lie_inside_the_ranges():
    for name in ("requirements.txt", "requirements-floor.txt"):
        pins = _pins(name)
        for requirement in _ranges():
            version = pins.get(requirement.name.lower())
            if version is not None:
                assert requirement.specifier.contains(version), f"{name}: {version} outside {requirement}"


def test_the_smoke_subset_names_existing_tests():
    makefile = (REPO / "Makefile").read_text()
    smoke = makefile.split("SMOKE :=")[1].split("\n\n")[0].replace("\\\n", " ").split()
    assert smoke, "Makefile: SMOKE is empty"
    for test in (t.strip('"') for t in smoke):
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        assert not name or f"def {name.split('[')[0]}(" in (REPO / path).read_text(), test


def test_the_notebooks_default_install_source_is_the_one_the_notebooks_guide_documents():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    assert f"`{make_notebooks.PIP_SPEC}`" in (REPO / "docs" / "guide" / "notebooks.md").read_text()


def test_the_project_urls_and_the_citation_name_the_repository_the_install_line_uses():
    import tomllib

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Repository"] == make_notebooks.REPO_URL
    assert f'repository-code: "{make_notebooks.REPO_URL}"' in (REPO / "CITATION.cff").read_text()
