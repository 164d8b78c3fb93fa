"""Session-wide runs that several test modules read (tests/shared_runs.py)."""

import pytest

from tests import shared_runs


@pytest.fixture(scope="session")
def tiny_cli_run(tmp_path_factory) -> shared_runs.CliRun:
    """``python train.py RUN`` started in the background; ``.result()`` waits for it."""
    run = shared_runs.start_cli_run(tmp_path_factory.mktemp("tiny_cli"))
    yield run
    if run.proc.poll() is None:
        run.proc.kill()
        run.proc.communicate()


@pytest.fixture(scope="session")
def tiny_api_run(tmp_path_factory):
    """``prefzoo.train(RUN)`` in this process: (result, trainer, run folder)."""
    return shared_runs.api_run(tmp_path_factory.mktemp("api"))
