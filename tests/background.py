"""Subprocess runs that start when the session starts and run one at a time beside the in-process tests.

A test module registers a run at import (:func:`register`): a name, the modules whose tests read it, and a
``prepare(base)`` that writes what the run needs under its own folder ``base`` and returns the command. When the
session's first test starts, tests/conftest.py starts a runner thread (:func:`start`) that works through the runs of
the selected modules one at a time, in the order those modules' tests come. A test then waits for its run with
:meth:`Job.result`; a run the runner has not reached yet is started at once, in the test's thread.

Why: a ``python train.py ...`` subprocess keeps one core busy while pytest waits for it, and the other core of a
2-core machine idles; in the background it runs while the in-process tests use the other core. What each test
checks is unchanged: the same command, its exit status, its console and its files. ``PREFZOO_TEST_BACKGROUND=0``
turns the runner off: each run then starts when its test asks for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class Command:
    args: list[str]
    cwd: Path
    env: dict | None = None
    timeout: float = 600


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    base: Path  # the run's own folder (prepare's ``base``)


def _die_with_parent() -> None:
    """(In the child, Linux) get SIGKILL when the thread that started it ends, e.g. pytest itself killed: no run
    outlives the session. Elsewhere nothing (the session's end still kills what runs: :meth:`Runner.stop`)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Job:
    def __init__(self, name: str, modules: tuple[str, ...], prepare: Callable[[Path], Command]):
        self.name, self.modules, self.prepare = name, modules, prepare
        self.base: Path | None = None
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self.proc: subprocess.Popen | None = None

    def _claim(self) -> bool:
        with self._lock:
            if self._started:
                return False
            self._started = True
            return True

    def _run(self) -> None:
        try:
            if self.base is None:
                raise RuntimeError(f"background run {self.name!r}: the session's runner was not started "
                                   "(tests/conftest.py)")
            command = self.prepare(self.base)
            out, err = self.base / f"{self.name}.stdout", self.base / f"{self.name}.stderr"
            with open(out, "w") as stdout, open(err, "w") as stderr:  # files: nobody reads while it runs
                self.proc = subprocess.Popen(command.args, cwd=command.cwd, env=command.env, stdout=stdout,
                                             stderr=stderr, preexec_fn=_die_with_parent)
            try:
                self.proc.wait(timeout=command.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._result = Result(self.proc.returncode, out.read_text(), err.read_text(), self.base)
        except BaseException as error:  # noqa: BLE001 (raised again in the test that waits)
            self._error = error
        finally:
            self._done.set()

    def result(self) -> Result:
        """Wait for the run (starting it here if the runner has not yet): its exit status, console and folder."""
        if self._claim():
            self._run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


JOBS: dict[str, Job] = {}


def register(name: str, modules: str | tuple[str, ...], prepare: Callable[[Path], Command]) -> Job:
    """The run ``name`` read by the tests of ``modules`` (their ``__name__``); registered once per session."""
    if name not in JOBS:
        JOBS[name] = Job(name, (modules,) if isinstance(modules, str) else tuple(modules), prepare)
    return JOBS[name]


class Runner:
    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.thread = threading.Thread(target=self._work, name="background-runs", daemon=True)
        self._stop = threading.Event()

    def _work(self) -> None:
        for job in self.jobs:
            if self._stop.is_set():
                return
            if job._claim():
                job._run()

    def stop(self) -> None:
        """At the session's end: no further run starts, and what still runs is killed."""
        self._stop.set()
        for job in self.jobs:
            job.kill()


def start(tmp_path_factory, items) -> Runner:
    """Give each registered run a folder of its own and start the runner on the runs one of whose modules has a
    selected test among ``items`` (the session's), in the order of those modules' first tests."""
    first = {}
    for position, item in enumerate(items):
        module = getattr(getattr(item, "module", None), "__name__", None)
        first.setdefault(module, position)
    selected = [job for job in JOBS.values() if any(m in first for m in job.modules)]
    jobs = sorted(selected, key=lambda job: min(first[m] for m in job.modules if m in first))
    for job in JOBS.values():
        job.base = tmp_path_factory.mktemp(f"bg_{job.name}")
    runner = Runner(jobs if os.environ.get("PREFZOO_TEST_BACKGROUND", "1") != "0" else [])
    runner.thread.start()
    return runner
