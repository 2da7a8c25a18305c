"""The processes llmgw starts: a child dies with its parent, and a group with its leader.

An engine runs in its own session, so the signals that end its agent do not reach it,
and a SIGKILLed agent stops nothing: without this an engine lives on under init, and
the next agent starts a second one on the same GPUs. The projector's DuckDB writer
likewise must never hold the file after its projector is gone. Linux's
PR_SET_PDEATHSIG has the kernel send SIGKILL when the parent's thread that forked the
child exits; elsewhere nothing is done (the pipes' EOF ends what reads them).

An engine's own children (vLLM's EngineCore and workers) inherit its output pipe and
outlive a leader that is killed: a process's exit is seen from the process (``exited``),
never from its pipes, and the group it led is ended with it (``kill_group``, ``group_members``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
if sys.platform == "linux":
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)  # loaded here: a child between fork and exec only calls it

__all__ = ["descendants", "die_with", "die_with_parent", "exited", "group_members", "kill_group", "resident_mib"]


def die_with_parent(parent: int | None = None) -> None:
    """Have this process killed when its parent exits (Linux); with ``parent``, also die now if
    that process is no longer the parent (it died before the call: this one was orphaned already)."""
    if _libc is None:
        return
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with ``parent``; None where the platform cannot.

    The kernel signals when the thread that forked the child exits, so a caller starts its
    children from a thread that lives as long as it does (the agent: its event loop's).
    """
    return functools.partial(die_with_parent, parent) if _libc is not None else None


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal every process of a group (a session started with ``start_new_session``: its leader's pid);
    False when none is left to signal."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stats(proc: Path) -> Iterator[tuple[int, bytes, int, int]]:
    """(pid, state, parent pid, process group) of every process /proc shows (Linux); none elsewhere."""
    try:
        entries = list(proc.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            state, ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]  # the name may hold spaces and parentheses
            yield int(entry.name), state, int(ppid), int(pgrp)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read


def group_members(pgid: int, proc: Path = Path("/proc")) -> set[int]:
    """The processes of a group still alive (Linux: /proc/*/stat; zombies hold nothing); empty elsewhere."""
    return {pid for pid, state, _, pgrp in _stats(proc) if pgrp == pgid and state not in (b"Z", b"X")}


def descendants(pids: Iterable[int], proc: Path = Path("/proc")) -> set[int]:
    """``pids`` and every process below them (Linux: parents from /proc/*/stat); just ``pids`` elsewhere.

    vLLM's GPU workers are its children (tp > 1: one per GPU), and what NVML lists on a GPU is
    theirs, not the ``vllm serve`` process the agent started.
    """
    out = set(pids)
    children: dict[int, list[int]] = {}
    for pid, _, ppid, _ in _stats(proc):
        children.setdefault(ppid, []).append(pid)
    stack = list(out)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def resident_mib(pids: Iterable[int], proc: Path = Path("/proc")) -> int:
    """The resident memory of these processes together, in MiB (Linux: /proc/PID/statm); 0 elsewhere.

    A simulated GPU's stand-in for what a real engine on the host's CPU holds: its weights (mapped
    from the file, once read) and its KV cache are in its resident set. Pages the processes share
    are counted once per process, as NVML counts each process's memory on a GPU."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    pages = 0
    for pid in set(pids):
        try:
            pages += int((proc / str(pid) / "statm").read_bytes().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return pages * page // (1 << 20)


async def exited(proc: asyncio.subprocess.Process, poll_s: float = 0.5) -> int:
    """The exit status of a process once it has exited, however long its children hold its pipes open.

    asyncio's ``wait()`` (3.11) resolves only once every pipe has closed as well. Linux's pidfd
    (5.3+) says when the process itself is gone, and ``returncode`` follows as soon as the loop
    has reaped it; ``returncode`` is also read every ``poll_s``, which is all there is without a pidfd.
    """
    with _pidfd_exit(proc.pid) as gone:
        while proc.returncode is None:
            if gone is not None and not gone.done():
                await asyncio.wait([gone], timeout=poll_s)
            else:  # gone, and the loop reaps it next; or nothing says when
                await asyncio.sleep(0.01 if gone is not None else poll_s)
    return proc.returncode


@contextlib.contextmanager
def _pidfd_exit(pid: int) -> Iterator[asyncio.Future[None] | None]:
    """A future done once ``pid`` has exited, as its pidfd says; None where there is no pidfd to say."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    fd = _pidfd(pid)
    if fd == _REAPED:
        gone.set_result(None)
    elif fd is None or not _watch(loop, fd, gone):
        yield None
        return
    try:
        yield gone
    finally:
        if fd != _REAPED:
            loop.remove_reader(fd)
            os.close(fd)
        gone.cancel()


_REAPED = -1


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; ``_REAPED`` when it is reaped already (its returncode is set or about to be);
    None on a platform or kernel without pidfds."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return int(pidfd_open(pid))
    except ProcessLookupError:
        return _REAPED
    except OSError:
        return None


def _watch(loop: asyncio.AbstractEventLoop, fd: int, gone: asyncio.Future[None]) -> bool:
    """Have the loop end ``gone`` once ``fd`` is readable; False (``fd`` closed) where it cannot."""
    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    try:
        loop.add_reader(fd, readable)
    except (NotImplementedError, OSError):
        os.close(fd)
        return False
    return True
