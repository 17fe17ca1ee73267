"""Shared pytest setup: the declared test dependencies, the hypothesis profiles, the eager
one-pass update.

Every package of ``pyproject.toml``'s ``test`` extra must import, or the run stops before
collecting: a test dependency installed on one machine by hand and never declared (or declared
and not installed) would otherwise make tests skip or fail to collect on the next machine.

``ci`` (the default) keeps the whole suite fast on two cores; ``thorough`` is for a nightly or
pre-release run and is selected with ``DTYPEPLAN_HYPOTHESIS_PROFILE=thorough``. Tests take
their example counts from the loaded profile (``settings.default.max_examples``), scaled down
for the ones that build optimizers, so one switch sizes every property test.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from packaging.requirements import Requirement  # pytest's own dependency

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# The import name of each test requirement whose distribution name differs from it.
_IMPORT_NAMES = {"types-PyYAML": None, "types-jsonschema": None}


def declared_test_imports() -> list[str]:
    """The module names that pyproject.toml's ``test`` extra promises on this Python (stub
    packages have none)."""
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    names = []
    for line in pyproject["project"]["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        module = _IMPORT_NAMES.get(requirement.name, requirement.name.replace("-", "_"))
        if module is not None:
            names.append(module)
    return names


CUDA_ONLY_ENV = "DTYPEPLAN_CUDA_TESTS_ONLY"
"""Set to 1 (``benchmarks/gpu/run_all.sh``): collect only the tests that need CUDA, those with
a skip condition whose reason names CUDA, and do not ask for the test extra's other packages
(the GPU script installs what those tests import, not the docs and frameworks)."""


def is_cuda_test(item: pytest.Item) -> bool:
    return any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(CUDA_ONLY_ENV) != "1":
        return
    deselected = [item for item in items if not is_cuda_test(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if is_cuda_test(item)]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(CUDA_ONLY_ENV) == "1":
        return
    missing = [name for name in declared_test_imports() if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(
            f"test dependencies declared in pyproject.toml are not installed: {missing}; "
            'install them with: python3 -m pip install -e ".[test]"'
        )


PROFILE_ENV = "DTYPEPLAN_HYPOTHESIS_PROFILE"

# Deadlines are off: the first torch call of a process (kernel dispatch warm-up) can take far
# longer than later ones, which would make a deadline flaky without saying anything useful.
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))

if os.environ.get("NODE_RANK") is not None and os.environ.get("LOCAL_RANK", "0") != "0":
    # Lightning's subprocess launcher, started in a spawned rank that lacked the launcher's
    # variables, runs the rank's command line again for each other rank: pytest's own, so
    # the whole run again beside this one, unseen, until the run ends (a test worker must set
    # LOCAL_RANK, tests/workers/integrations._env).
    raise SystemExit(
        "this pytest was started by a framework's launcher as local rank "
        f"{os.environ['LOCAL_RANK']}: a test worker runs Lightning without LOCAL_RANK set"
    )

# The one-pass host update runs eagerly in tests (the same bits as compiled, without seconds of
# compiling in every process; spawned ranks inherit it): tests/test_update_kernel.py compares
# the compiled kernel with it.
os.environ.setdefault("DTYPEPLAN_EAGER_UPDATE", "1")


@pytest.fixture(scope="session")
def integration_defaults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The default run's framework cases and README recipes (tests/test_integrations_*.py),
    in one spawned group of 2 ranks: each group imports transformers, Accelerate and
    Lightning, which costs more than the cases."""
    from dtypeplan.launch import spawn
    from tests._helpers import readme_recipe_blocks
    from tests.workers.integrations import default_group

    root = str(tmp_path_factory.mktemp("integrations"))
    return spawn(default_group, 2, root, readme_recipe_blocks(), timeout_s=900)
