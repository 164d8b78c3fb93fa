"""Session-wide runs that several test modules read (tests/shared_runs.py), the subprocess runs that work in the
background while the in-process tests run (tests/background.py), and the two torch thread counts of the numerics tests
(marker ``numerics``).

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadscope``: a module's tests, and so its
module-scoped runs, stay on one worker), each on one torch thread (``OMP_NUM_THREADS=1``). There the background runner is
off (both cores are busy already, and every worker collects every test: each would start every run): a registered run
starts when its first test asks for it (:meth:`tests.background.Job.result`).

Marker ``numerics``: the test compares two floating-point computations that sum in different orders (a fused pass and a
plain one, sharded and whole, the decode loop and the policy's pass) within a derived bound. It runs twice, at 1 and at 2
torch threads (``[threads1]``, ``[threads2]``): the reduction order changes with the thread count, so a bound that holds
at one thread count only fails here, on the developer's machine, before it fails on another (issue 46). A test that
launches processes of its own reads the count from its ``torch_threads`` argument.
"""

import os

import pytest
import torch

from tests import background, shared_runs

#: the torch thread counts a ``numerics`` test runs at
NUMERICS_THREADS = (1, 2)


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
    """Starts the registered subprocess runs of the selected modules, one at a time, when the first test starts (not
    under pytest-xdist: see the module docstring)."""
    items = [] if os.environ.get("PYTEST_XDIST_WORKER") else request.session.items
    runner = background.start(tmp_path_factory, items)
    yield runner
    runner.stop()


def pytest_generate_tests(metafunc):
    """A ``numerics`` test runs at each of :data:`NUMERICS_THREADS` torch threads (its ``torch_threads`` fixture)."""
    if metafunc.definition.get_closest_marker("numerics") is not None:
        if "torch_threads" not in metafunc.fixturenames:
            metafunc.fixturenames.append("torch_threads")
        metafunc.parametrize("torch_threads", NUMERICS_THREADS, indirect=True,
                             ids=[f"threads{n}" for n in NUMERICS_THREADS])


@pytest.fixture
def torch_threads(request):
    """The torch thread count of this run of a ``numerics`` test (1 elsewhere: the workers' own), set for the test and
    restored after it."""
    n = getattr(request, "param", None)
    if n is None:
        yield torch.get_num_threads()
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


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


#: the longest test files first (measured with ``--durations``, 2 cores, one torch thread per worker: each holds a
#: minute or more of runs or a module fixture that trains), so that xdist's ``--dist loadscope``, which hands out files
#: in collection order, does not end with one worker running a long file while the other waits
LONGEST_FIRST = ("tests/rollout/test_async_rollouts.py", "tests/distributed/test_fsdp.py",
                 "tests/report/test_overoptimisation_recipes.py", "tests/test_faults_round4.py",
                 "tests/distributed/test_data_parallel.py", "tests/test_bad_inputs.py", "tests/report/test_report.py",
                 "tests/test_packaging.py", "tests/environments/test_env_runs.py", "tests/test_bad_inputs_runs.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: file order kept otherwise
    selected = "real_model" in (config.getoption("-m") or "")
    for item in items:
        if "real_model" in item.keywords and not selected:
            item.add_marker(pytest.mark.skip(reason="samples SmolLM2 for minutes: run it with pytest -m real_model"))
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(FAST_PATHS) and not any(word in item.name for word in NOT_FAST_WORDS):
            item.add_marker(pytest.mark.fast)
