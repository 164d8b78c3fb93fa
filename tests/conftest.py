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
