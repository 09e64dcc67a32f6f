"""The torch this package accepts (setup.py), as docs/install.md states it,
and the core set that `make test-torch` runs under each torch of the range."""

import ast
from pathlib import Path

from conftest import CORE
from packaging.requirements import Requirement
from pages import fenced_blocks

ROOT = Path(__file__).parent.parent


def torch_requirement() -> Requirement:
    setup = ast.parse((ROOT / "setup.py").read_text())
    install_requires = next(k.value for node in ast.walk(setup) if isinstance(node, ast.Call)
                            for k in node.keywords if k.arg == "install_requires")
    (torch,) = [Requirement(e.value) for e in install_requires.elts if Requirement(e.value).name == "torch"]
    return torch


def test_setup_accepts_torch_from_2_6_on_and_a_build_of_2_6_that_calls_itself_a_prerelease():
    """pip holds an installed torch to the range with pre-releases allowed: a
    build of 2.6 from source or a container (2.6.0a0+<commit>) must be in it,
    or pip replaces it."""
    specifier = torch_requirement().specifier
    for version in ("2.6.0", "2.6.0+cu124", "2.6.0a0+ecf3bae40a", "2.7.0a0+7c8ec84dab", "2.13.0+cpu", "2.15.0"):
        assert specifier.contains(version, prereleases=True), version
    for version in ("2.5.1", "2.5.1+cu124", "2.6.0.dev20241101"):
        assert not specifier.contains(version, prereleases=True), version


def test_the_install_page_states_the_range_setup_py_declares():
    assert f"`{torch_requirement()}`" in (ROOT / "docs" / "install.md").read_text()


def test_the_core_set_names_test_modules_that_exist():
    assert all((ROOT / "tests" / name).is_file() for name in CORE)


def test_the_readme_and_the_install_page_install_beside_a_torch_alike():
    """`make test-torch` runs the README's block and refuses to run if this page's differs."""
    beside = [[b.text for b in fenced_blocks(page) if b.marker == "run by Makefile"]
              for page in (ROOT / "README.md", ROOT / "docs" / "install.md")]
    assert beside[0] and beside[0] == beside[1]
