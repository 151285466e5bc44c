"""Files that appear whole or not at all, and interruptions that leave none half-written.

Every file a command writes (a wheel, a downloaded wheel in the cache, a cached
screen verdict, a report) is written under a temporary name beside its final
name and moved into place with ``os.replace`` only once it is complete: a
reader (pip, another process) sees the earlier file or the new one, never a
part.  An exception, or a signal that ends a command (:data:`STOPPING_SIGNALS`:
Ctrl-C's SIGINT, SIGTERM, and SIGHUP, which a closed terminal or ssh session
sends) under :func:`interruptions_unwind` removes the temporary file and any
folder the command created for it.

Only a regular file is replaced.  A target that exists as anything else (a
folder, a device such as /dev/null, a FIFO, a socket) is refused with
:class:`CannotWrite`, and left as it is.  A symbolic link is written through:
the regular file it names is replaced (atomically, in that file's folder) and
the link stays; a link to anything but a regular file is refused like its
target.  A write that fails (no space, no permission, a read-only file
system) raises :class:`CannotWrite`, which names the path.
Standard library only: the plugin's start-up path uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType


class CannotWrite(OSError):
    """A file could not be written whole: the message names the path and why."""

    def __init__(self, target: Path, reason: str) -> None:
        super().__init__(f"cannot write {str(target)!r}: {reason}")
        self.reason = reason


# Errors of a write itself (not of what the block reads): named after the
# target, not the temporary file they happened in.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES})


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def write_target(target: Path) -> Path:
    """The path whose file writing ``target`` replaces: ``target``, or the file
    a symbolic link at ``target`` names.  Raises :class:`CannotWrite` where that
    exists and is not a regular file (it is never replaced)."""
    linked = target.is_symlink()
    try:
        mode = os.stat(target).st_mode  # through links as the kernel follows them (/proc/self/fd/1)
    except (FileNotFoundError, NotADirectoryError):
        mode = stat.S_IFREG  # nothing there yet: the file is created (or its folder is missing)
    except OSError as exc:  # a link loop, a folder it may not look into
        raise CannotWrite(target, exc.strerror or str(exc)) from None
    if not stat.S_ISREG(mode):
        kind = kind_of(mode)
        shown = f"a link to {kind} ({os.readlink(target)})" if linked else kind
        if stat.S_ISDIR(mode):
            raise CannotWrite(target, f"it is {shown}; give a file name")
        raise CannotWrite(target, f"it is {shown}, not a regular file; it is left as it is")
    return Path(os.path.realpath(target)) if linked else target


# The signals whose default action ends a command and that it is sent to
# stop: each is unwound alike (temporary files removed, children ended).
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _watched() -> tuple[signal.Signals, ...]:
    """The stopping signals to act on: all but a SIGHUP ignored by ``nohup``,
    which asks that a closed terminal not stop the command."""
    return tuple(
        signum
        for signum in STOPPING_SIGNALS
        if not (signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN)
    )


def _temporary_name(target: Path) -> Path:
    # A hidden name that does not end like the target (no ".whl"), so that
    # nothing that scans the folder mistakes it for a finished file.
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(
    folder: Path, log: Callable[[str], None] = lambda line: None
) -> list[Path]:
    """Remove the temporary files :func:`replacing` left in ``folder`` when
    its process was killed (SIGKILL, a power cut): those named after a
    process that is gone.  Returns what it removed."""
    removed = []
    for path in folder.iterdir():
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or _alive(int(match["pid"])) or not path.is_file():
            continue
        with contextlib.suppress(FileNotFoundError):  # another build removed it first
            path.unlink()
            removed.append(path)
            log(f"removed {path.name}, left by a build that was stopped (process {match['pid']})")
    return removed


@contextlib.contextmanager
def folder_lock(folder: Path, on_wait: Callable[[str], None] = lambda line: None) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` itself (flock on the folder: no
    lock file is left behind) for the block; a second holder waits.  The
    kernel drops it when the process dies, however it dies."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"waiting for another build writing into {folder}")
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary path in ``target``'s folder for the block to write (and check);
    it replaces ``target`` when the block ends normally.  On any exception
    (KeyboardInterrupt and :class:`Interrupted` included) it is removed and
    ``target`` is left as it was.  ``target`` is checked first
    (:func:`write_target`); a failed write raises :class:`CannotWrite`."""
    final = write_target(target)
    temporary = _temporary_name(final)
    try:
        # Created with the mode a plain open() gives (0o666 less the umask),
        # not mkstemp's 0o600: the finished file is shared like any other.
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise CannotWrite(target, exc.strerror or str(exc)) from None
    try:
        try:
            yield temporary
        except CannotWrite:
            raise
        except OSError as exc:
            if exc.errno in _WRITE_ERRNOS:
                raise CannotWrite(target, exc.strerror or str(exc)) from None
            raise
        try:
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())  # on disk before the name points at it
            write_target(target)  # it may have become something else meanwhile
            os.replace(temporary, final)
        except CannotWrite:
            raise
        except OSError as exc:
            raise CannotWrite(target, exc.strerror or str(exc)) from None
    finally:
        temporary.unlink(missing_ok=True)


def write_atomic(target: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``target`` whole, or leave ``target``
    as it was and raise :class:`CannotWrite`."""
    with replacing(target) as temporary:
        try:
            temporary.write_bytes(data.encode() if isinstance(data, str) else data)
        except OSError as exc:
            raise CannotWrite(target, exc.strerror or str(exc)) from None


@contextlib.contextmanager
def folder(path: Path) -> Iterator[Path]:
    """``path`` as a folder, created with its missing parents; when the block
    raises, the folders it created are removed again (if still empty)."""
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    try:
        path.mkdir(parents=True, exist_ok=True)
        yield path
    except BaseException:
        for created in missing:  # deepest first
            with contextlib.suppress(OSError):
                created.rmdir()
        raise


class Interrupted(BaseException):
    """One of :data:`STOPPING_SIGNALS` arrived; raised where the program was, so that every
    ``finally`` on the way out runs (a BaseException, like KeyboardInterrupt:
    ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 129 SIGHUP, 130 SIGINT, 143 SIGTERM


@contextlib.contextmanager
def interruptions_unwind() -> Iterator[None]:
    """Inside this block the first of :data:`STOPPING_SIGNALS` raises :class:`Interrupted`;
    later ones are ignored until the block has exited, so that the clean-up the
    first one started is not itself cut short."""
    watched = _watched()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for other in watched:
            signal.signal(other, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in watched}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def interruptions_between_steps() -> Iterator[Callable[[], None]]:
    """Inside this block one of :data:`STOPPING_SIGNALS` is noted, not raised where the
    program happens to be; the block calls the function it is given at each
    point where stopping is safe (between two zip entries: ``zipfile`` cannot
    be unwound from inside an entry), and that raises :class:`Interrupted`.
    A signal still pending when the block ends is raised there.  Once one
    has arrived, later ones are ignored until an enclosing
    :func:`interruptions_unwind` block has exited."""
    watched = _watched()
    pending: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        for other in watched:
            signal.signal(other, signal.SIG_IGN)
        pending.append(signum)

    def stop_if_signalled() -> None:
        if pending:
            raise Interrupted(pending[0])

    previous = {signum: signal.signal(signum, note) for signum in watched}
    try:
        yield stop_if_signalled
        stop_if_signalled()
    finally:
        if not pending:  # else the signals stay ignored while the clean-up runs
            for signum, handler in previous.items():
                signal.signal(signum, handler)
