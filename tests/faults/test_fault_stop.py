"""Stopping as ``llmgw up`` stops its children: SIGTERM to each child's whole process group."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from llmgw.errors import ProjectionError
from llmgw.fleet.fold import encode_state
from llmgw.fleet.state import Cursor, FleetState
from llmgw.projections.store import Batch
from llmgw.projections.writer import ProcessWriter


def test_the_duckdb_writer_outlives_its_groups_sigterm_and_a_dead_one_is_a_projection_error(tmp_path: Path) -> None:
    """SIGTERM to the group must not take the writer away under the projector's last commit; and
    a writer that died anyway (SIGKILL, OOM) is a ProjectionError, never a bare ConnectionResetError."""
    snapshot = encode_state(FleetState(), Cursor())
    writer = ProcessWriter(tmp_path / "w.duckdb", None, 0)
    try:
        pid = writer._proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGTERM)  # what `llmgw up` sends the projector's group on Ctrl-C
        writer.commit(Batch(), snapshot)  # the parent decides when it stops
        os.kill(pid, signal.SIGKILL)
        writer._proc.join(10)
        with pytest.raises(ProjectionError, match="writer process died"):
            writer.commit(Batch(), snapshot)
    finally:
        writer.close()
