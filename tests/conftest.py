"""Session-wide runs that several test modules read (tests/shared_runs.py), and the subprocess runs that work in the
background while the in-process tests run (tests/background.py)."""

import pytest

from tests import background, shared_runs


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
    """Starts the registered subprocess runs of the selected modules, one at a time, when the first test starts."""
    runner = background.start(tmp_path_factory, request.session.items)
    yield runner
    runner.stop()


@pytest.fixture(scope="session")
def tiny_cli_run() -> background.Job:
    """``python train.py RUN`` (tests/shared_runs.py), a background run; ``.result()`` waits for it."""
    return shared_runs.CLI_RUN


@pytest.fixture(scope="session")
def tiny_api_run(tmp_path_factory):
    """``prefzoo.train(RUN)`` in this process: (result, trainer, run folder)."""
    return shared_runs.api_run(tmp_path_factory.mktemp("api"))


#: the test files of ``make test-fast`` (marker ``fast``): the maths, the plugins' formulas, the architecture and the
#: config checks -- every formula test, none of the runs (under 2 minutes on 2 cores; ``make test`` runs everything)
FAST_PATHS = ("tests/objective/", "tests/lab/test_oracles.py", "tests/test_architecture.py", "tests/test_config.py",
              "tests/algos/")
#: within those files, the tests that train a model or start a process are not fast
NOT_FAST_WORDS = ("tiny_model", "command_line", "through_the_loop", "trains_two_steps_on", "real_model")


def pytest_collection_modifyitems(config, items):
    selected = "real_model" in (config.getoption("-m") or "")
    for item in items:
        if "real_model" in item.keywords and not selected:
            item.add_marker(pytest.mark.skip(reason="samples SmolLM2 for minutes: run it with pytest -m real_model"))
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(FAST_PATHS) and not any(word in item.name for word in NOT_FAST_WORDS):
            item.add_marker(pytest.mark.fast)
