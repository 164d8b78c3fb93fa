"""The run folder before a run starts: it can be written, no other run uses it, and what a resume continues from.

* :func:`check_output_dir`: a folder that is a file, lies under a file, or cannot be written is refused in one line
  (``train.py`` checks ``hydra.run.dir`` before Hydra creates it, and that no run holds it, before Hydra writes its
  ``.hydra/`` there: :func:`refuse_unusable_output_dir`).
* :func:`lock_run_folder`: an exclusive ``flock`` on ``<run>/.prefzoo.lock``, which records the holder (pid, host,
  start time). A second run in the folder is refused naming the holder; the kernel drops the lock of a process that
  died, so a stale lock file is taken over (with a warning naming the process that left it). Only the main process
  of a data-parallel run takes it.
* :func:`open_run_folder`: both, then the resume point (:func:`prefzoo.training.resume.find_resume_point`), decided by
  the main process and shared with the others, all before any model loads.
* Nothing is written into the folder before it is accepted: the command line keeps Hydra from writing ``.hydra/``
  (``hydra.output_subdir=null``, :func:`prefzoo.commands.train`) and writes it itself once the folder is accepted
  (:func:`write_hydra_files`), and the run's ``train.log`` handler holds its records until then
  (:class:`DeferredFileHandler`, ``conf/hydra/job_logging/prefzoo.yaml``; :func:`open_run_log`). A refused run (a
  finished run's folder, a folder in use, a resume with other settings) leaves every file of the folder as it was.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from prefzoo.errors import PrefzooError, RunFolderError
from prefzoo.training.layout import LOCK_FILE

log = logging.getLogger(__name__)

_held: dict[str, int] = {}  # resolved run folder -> the file descriptor holding its lock (this process)


def check_output_dir(path: Path) -> None:
    """Raise :class:`RunFolderError` unless ``path`` is (or can be created as) a writable folder."""
    path = Path(path)
    fix = "choose another folder with hydra.run.dir=<folder>"
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"the output folder {path} is a file, not a folder; {fix}.")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RunFolderError(f"the output folder {path} cannot be created: {existing} is a file, not a folder; {fix}.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".prefzoo-probe-", dir=existing))
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise RunFolderError(f"the output folder {path} cannot be written ({existing}: {reason}); {fix}.") from None


def output_dir_of(argv: list[str]) -> Path | None:
    """The folder a ``train.py`` command line will write to (``hydra.run.dir``, ``hydra.sweep.dir`` with ``-m``;
    Hydra's defaults ``outputs/`` / ``multirun/`` under the current folder), or None when it writes none or it
    cannot be told (``--cfg``, ``--help``, an interpolation)."""
    args = argv[1:]
    if any(a in ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")
           or a.startswith(("--cfg=", "--info=")) for a in args):
        return None
    multirun = any(a in ("-m", "--multirun") for a in args)
    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    value = None
    for a in args:
        if a.lstrip("+").startswith(key):
            value = a.lstrip("+")[len(key):]
    if value is None:
        return Path("multirun" if multirun else "outputs")
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return None if "${" in value or not value else Path(value)


def refuse_unusable_output_dir(argv: list[str]) -> None:
    """``train.py``: exit with status 2 and one ``prefzoo: error:`` line when the output folder of the command line
    cannot be used, before Hydra tries to create it (its own failure is a traceback).

    A run folder named on the command line (``hydra.run.dir=...``, one run) is also LOCKED here, by the main process,
    before Hydra writes ``.hydra/`` and its log there: of two runs started a second apart in one folder, the second is
    refused before it writes anything, so the first run's records (its ``.hydra/overrides.yaml``, the command in its
    model card) stay its own. The lock is released when the process ends (:func:`unlock_run_folder` at exit)."""
    import atexit

    from prefzoo.training.distributed import launched_rank

    path = output_dir_of(argv)
    if path is None:
        return
    try:
        check_output_dir(path)
        if launched_rank() == 0:  # before Hydra writes .hydra/ and its log there (the others: the main's folder)
            check_not_in_use(path)
            if _names_the_run_folder(argv):
                path.mkdir(parents=True, exist_ok=True)
                lock_run_folder(path)
                atexit.register(unlock_run_folder, path)
    except RunFolderError as err:
        if launched_rank() == 0:
            print(f"prefzoo: error: {err}", file=sys.stderr)
        sys.exit(2)


def _names_the_run_folder(argv: list[str]) -> bool:
    """Whether ``argv`` is one run (no ``-m``) with its folder given as ``hydra.run.dir`` (not Hydra's default,
    ``outputs/<date>/<time>-<algo>``, which is only known once Hydra has composed it)."""
    args = argv[1:]
    return (not any(a in ("-m", "--multirun") for a in args)
            and any(a.lstrip("+").startswith("hydra.run.dir=") for a in args))


def _holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that has not written its details yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def check_not_in_use(run_dir: Path) -> None:
    """Raise :class:`RunFolderError` naming the holder when another process holds ``run_dir``'s lock (a check only:
    the lock itself is taken by :func:`lock_run_folder`)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file() or str(Path(run_dir).resolve()) in _held:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _in_use_error(Path(run_dir), _holder(fd)) from None
    finally:
        os.close(fd)


def _in_use_error(run_dir: Path, holder: dict) -> RunFolderError:
    return RunFolderError(f"the run folder {run_dir} is in use by another run ({_describe(holder)}); wait until it "
                          "ends, or give this run another folder (hydra.run.dir=...).")


def lock_run_folder(run_dir: Path) -> None:
    """Take the run folder's lock for this process (again: nothing to do).

    Raises:
        RunFolderError: another live process holds it (the message names it).
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _holder(fd)
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _in_use_error(run_dir, holder) from None
        log.warning("cannot lock %s (%s): nothing stops a second run from using this folder at the same time",
                    path, err.strerror)
        return
    left = _holder(fd)
    if left and left.get("pid") != os.getpid():
        log.warning("taking over the lock of %s left by %s, which is no longer running", run_dir, _describe(left))
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    _held[key] = fd


def unlock_run_folder(run_dir: Path) -> None:
    """Release this process's lock of ``run_dir`` (if it holds it) and clear the holder's details."""
    fd = _held.pop(str(Path(run_dir).resolve()), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass
class RunFolder:
    """A run folder checked and locked by :func:`open_run_folder`; ``resume``: the checkpoint to continue from."""

    path: Path
    resume: object = None  # prefzoo.training.resume.ResumePoint | None


def open_run_folder(cfg, run_dir: Path, dp) -> RunFolder:
    """Check, create and lock ``run_dir`` and find what ``trainer.resume=true`` continues from (before any model
    loads). The main process decides; the others learn its answer (and raise its error)."""
    from prefzoo.training.resume import ResumePoint, find_resume_point

    run_dir = Path(run_dir)
    error, folder, point = None, None, None
    if dp.is_main:
        try:
            check_output_dir(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            lock_run_folder(run_dir)
            point = find_resume_point(cfg, run_dir)
            folder = str(point.folder) if point is not None else None
        except PrefzooError as err:
            error = err
    if dp.enabled:
        error, folder = dp.broadcast_object((error, folder))
        if not dp.is_main and folder is not None:
            point = ResumePoint(Path(folder))  # its trainer state is read by this process when it resumes
    if error is not None:
        raise error
    return RunFolder(run_dir, point)


# ------------------------------------------------------------------------------ what is written once it is accepted
#: the environment variable through which ``prefzoo train`` tells the run where Hydra's ``.hydra/`` goes (Hydra's own
#: ``hydra.output_subdir``, which the command line sets to null so that Hydra writes nothing before the check); empty:
#: nowhere (the user set ``hydra.output_subdir=null``); unset: Hydra wrote it itself (not through ``prefzoo train``)
HYDRA_SUBDIR_ENV = "PREFZOO_HYDRA_SUBDIR"

_deferred: "weakref.WeakSet[DeferredFileHandler]" = weakref.WeakSet()


class DeferredFileHandler(logging.Handler):
    """A log file handler that holds its records (formatted) in memory until :meth:`open`, then appends them to
    ``filename`` and writes every later record there as :class:`logging.FileHandler` does. A handler never opened
    writes nothing (a refused run: the folder it would have written into stays as it was). Hydra's job logging builds
    it (``conf/hydra/job_logging/prefzoo.yaml``); :func:`open_run_log` opens it once the run folder is accepted."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = "utf-8"):
        super().__init__()
        self.filename = os.path.abspath(filename)
        self.mode, self.encoding = mode, encoding
        self._lines: list[str] = []
        self._file: logging.FileHandler | None = None
        _deferred.add(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is not None:
            self._file.emit(record)
            return
        try:
            if len(self._lines) < 100_000:  # (a run that logs this much before its folder is checked: the rest dropped)
                self._lines.append(self.format(record))
        except Exception:  # noqa: BLE001 -- logging's own convention: a record that cannot be formatted is reported
            self.handleError(record)

    def open(self) -> None:
        """Create the file (append), write the held records, and write every later record there."""
        if self._file is not None:
            return
        self._file = logging.FileHandler(self.filename, mode=self.mode, encoding=self.encoding)
        self._file.setFormatter(self.formatter)
        self._file.setLevel(self.level)
        if self._lines:
            self._file.stream.write("".join(line + self._file.terminator for line in self._lines))
            self._file.flush()
        self._lines = []

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._lines = []
        super().close()


def open_run_log(run_dir: Path) -> None:
    """Open the :class:`DeferredFileHandler` s that write into ``run_dir`` (the run's ``train.log``): the folder has been
    accepted."""
    folder = str(Path(run_dir).resolve())
    for handler in list(_deferred):
        if os.path.dirname(handler.filename) == folder:
            try:
                handler.open()
            except OSError as err:
                raise RunFolderError(f"cannot write the run's log {handler.filename} ({err.strerror or err}); free "
                                     "space on that disk or choose another folder (hydra.run.dir=...).") from None


def write_hydra_files(folder: Path, task_cfg, hydra_cfg, overrides: list[str]) -> None:
    """``folder/{config,hydra,overrides}.yaml`` as Hydra writes them (``hydra_cfg``: a config whose one key is
    ``hydra``).

    Raises:
        RunFolderError: the folder or a file cannot be written (a full disk, a read-only folder): one line.
    """
    from omegaconf import OmegaConf

    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, node in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg),
                           ("overrides.yaml", OmegaConf.create(list(overrides)))):
            if node is None:  # (the Python API with a typed Config: no Hydra node)
                continue
            with open(folder / name, "w", encoding="utf-8") as file:
                file.write(OmegaConf.to_yaml(node))
    except OSError as err:
        raise RunFolderError(f"cannot write the run's Hydra record into {folder} ({err.strerror or err}); free space "
                             "on that disk or choose another folder (hydra.run.dir=...).") from None


def record_hydra_run(run_dir: Path, task_cfg) -> None:
    """Under ``prefzoo train``: write Hydra's ``.hydra/`` record of this job into the accepted ``run_dir`` (Hydra was
    told not to write it before the folder was checked: :data:`HYDRA_SUBDIR_ENV`), and open its ``train.log``."""
    subdir = os.environ.get(HYDRA_SUBDIR_ENV)
    if subdir:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf, open_dict, read_write

        if HydraConfig.initialized() and HydraConfig.get().output_subdir is None:
            hydra_cfg = OmegaConf.masked_copy(HydraConfig.instance().cfg, "hydra")
            with read_write(hydra_cfg.hydra), open_dict(hydra_cfg.hydra):
                hydra_cfg.hydra.output_subdir = subdir  # as Hydra would have recorded it
            write_hydra_files(Path(run_dir) / subdir, task_cfg, hydra_cfg, list(HydraConfig.get().overrides.task))
    open_run_log(run_dir)
