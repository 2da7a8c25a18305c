"""Fault tests: real nats-server processes (single and 3-node clusters) that we kill and restart.

Counts (published, stored, read, duplicates) are printed by the ``record``
fixture (``pytest -s``) and appended to ``$LLMGW_FAULT_COUNTS`` when set;
docs/reliability.md quotes them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.bus.server import Cluster, start_cluster


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Print a test's counts (and append them to $LLMGW_FAULT_COUNTS) for the reliability doc."""

    def rec(**counts: Any) -> None:
        line = {"test": request.node.name, **counts}
        print(json.dumps(line))
        if path := os.environ.get("LLMGW_FAULT_COUNTS"):
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    return rec


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="llmgw-cluster-"))
    c = start_cluster(base)
    try:
        yield c
    finally:
        for s in c.servers:
            s.kill()
        shutil.rmtree(base, ignore_errors=True)


