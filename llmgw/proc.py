"""The processes llmgw starts: a child dies with its parent.

An engine runs in its own session, so the signals that end its agent do not reach it,
and a SIGKILLed agent stops nothing: without this an engine lives on under init, and
the next agent starts a second one on the same GPUs. The projector's DuckDB writer
likewise must never hold the file after its projector is gone. Linux's
PR_SET_PDEATHSIG has the kernel send SIGKILL when the parent's thread that forked the
child exits; elsewhere nothing is done (the pipes' EOF ends what reads them).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
if sys.platform == "linux":
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)  # loaded here: a child between fork and exec only calls it

__all__ = ["die_with", "die_with_parent"]


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
