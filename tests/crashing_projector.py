"""``llmgw project``, but SIGKILLed at a chosen event: the crash tests' wrapper, kept out of product code.

    python tests/crashing_projector.py N [project options]        # inside the commit that holds event N
    python tests/crashing_projector.py N:fold [project options]   # on the reading loop, right after folding event N

A kill inside a commit happens after every row is written and before COMMIT, in the
process that commits: the DuckDB writer child, which takes the projector with it,
or the projector itself when it commits on a thread. The writer child is started
with multiprocessing's spawn, which imports this file again as ``__mp_main__``, so
the patches below are applied there too; the target rides along in the environment.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Any

from llmgw.projections import runner, store

ENV = "LLMGW_TEST_CRASH_AT"


def _kill() -> None:
    if multiprocessing.parent_process() is not None:  # the writer child: the projector goes first
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(target: str) -> None:
    n_text, _, where = target.partition(":")
    n = int(n_text)
    if where == "fold":
        ingest = runner.Projector.ingest

        def ingest_then_die(self: runner.Projector, stream: str, msgs: list[Any]) -> None:
            keep = n - self.folded
            if keep <= len(msgs):
                if keep > 0:
                    ingest(self, stream, msgs[:keep])
                _kill()
            ingest(self, stream, msgs)

        runner.Projector.ingest = ingest_then_die  # type: ignore[method-assign]
        return
    commit = store.Store.commit
    committed = 0

    def commit_then_die(self: store.Store, batch: store.Batch, snapshot: bytes, before_commit: Any = None) -> None:
        nonlocal committed
        crash = committed + batch.events >= n
        commit(self, batch, snapshot, before_commit=_kill if crash else before_commit)
        committed += batch.events

    store.Store.commit = commit_then_die  # type: ignore[method-assign]


if __name__ == "__main__":
    os.environ[ENV] = sys.argv.pop(1)
_arm(os.environ[ENV])

if __name__ == "__main__":
    from llmgw.cli.main import cli

    cli(["project", *sys.argv[1:]], prog_name="llmgw")
