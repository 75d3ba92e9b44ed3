"""Starting, reading and ending the processes a test starts (train.py, torchrun and their workers),
each wait with a time limit: a child started as a terminal's job, its output line by line, every
process below a child, a poll for a condition with a deadline."""

from __future__ import annotations

import codecs
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil


def _default_ctrl_c() -> None:
    # a terminal's foreground job starts with Ctrl-C's default action; a test runner started in the
    # background of a script (``.ci/run &``) ignores SIGINT, which make (unlike torchrun and the
    # recipe's own processes, which install handlers) would keep
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_as_a_job(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` as a terminal (or SLURM) starts a job: in a session of its own, so its process group
    is the job's and a signal to the group reaches everything in it, with SIGINT's default action;
    stdout and stderr in one text pipe (read it with :func:`output_lines` or ``ChildLines``)."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_default_ctrl_c,
    )


def output_lines(process: subprocess.Popen, timeout_s: float) -> Iterator[str]:
    """The lines a child writes to its stdout pipe, as they come, until it closes the pipe. Past
    ``timeout_s`` the child and everything below it are killed and AssertionError shows the output
    so far."""
    deadline = time.monotonic() + timeout_s
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = process.stdout.fileno()  # below the file object: its readline would block past the limit
    pending, seen = "", []
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                kill_tree(process.pid)
                process.wait(timeout=60)
                raise AssertionError(
                    f"child {process.args!r} still writing after {timeout_s:.0f} s; its output:\n"
                    + "".join(seen)[-4000:]
                    + pending
                )
            chunk = os.read(fd, 65536)
            pending += decoder.decode(chunk, final=not chunk)
            *complete, pending = pending.split("\n")
            for line in complete:
                seen.append(line + "\n")
                yield line + "\n"
            if not chunk:
                if pending:
                    yield pending
                return


class ChildLines:
    """A child's output read as a test needs it: up to a line that matches, then on; one time limit
    (:func:`output_lines`) for all of it."""

    def __init__(self, process: subprocess.Popen, timeout_s: float):
        self._lines = output_lines(process, timeout_s)
        self.seen: list[str] = []

    def wait_for(self, pattern: str) -> str:
        """The next line that matches ``pattern``; AssertionError when the output ends first."""
        for line in self._lines:
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(
            f"the output ended without a line matching {pattern!r}:\n" + "".join(self.seen[-60:])
        )

    def all(self) -> str:
        """Everything, once the child has closed its output."""
        self.seen.extend(self._lines)
        return "".join(self.seen)


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` (none when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has ended: only its parent's wait is missing)."""
    running = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it."""
    for proc in [*descendants(pid), *([psutil.Process(pid)] if psutil.pid_exists(pid) else [])]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)  # polling an outside condition, not timing anything
