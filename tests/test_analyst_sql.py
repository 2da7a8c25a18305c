"""What analysts get: the snapshot in the DuckDB CLI, docs/data.md's queries and their outputs, the views' answers.

The DuckDB CLI is the one people install (``pip install duckdb-cli``), in its own
virtual environment next to the project's (scripts/test.sh makes it): the snapshot
must open there, not only in the duckdb Python package the projector writes with.
``LLMGW_UPDATE_DOCS=1`` rewrites the outputs in docs/data.md from what the CLI prints.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from datetime import UTC, date
from pathlib import Path

import duckdb
import pytest
from analyst_history import at, history, project
from projection_events import small_fleet, t

from llmgw import messages as m
from llmgw.agent.nvml import GPU_LOST, POWER_BRAKE, THERMAL, ecc_finding, xid_finding
from llmgw.projections import schema
from llmgw.projections.store import Store

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "data.md"
CLI = Path(os.environ.get("LLMGW_DUCKDB_CLI", ROOT / ".venv-duckdb-cli" / "bin" / "duckdb"))
# A query in docs/data.md, and the output printed under it.
_BLOCK = re.compile(r"```sql\n(.*?)```\n(?:\n```text\n(.*?)```\n)?", re.S)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The analysts' snapshot of three simulated days (tests/analyst_history.py)."""
    where = tmp_path_factory.mktemp("analyst")
    store = project(where / "llmgw.duckdb")
    try:
        yield store.export_copy(where / "llmgw.analysts.duckdb")
    finally:
        store.close()


def duckdb_cli(db: Path, sql: str) -> subprocess.CompletedProcess[str]:
    if not CLI.exists():
        pytest.fail(f"no DuckDB CLI at {CLI}: scripts/test.sh installs it (python3 -m venv .venv-duckdb-cli && "
                    ".venv-duckdb-cli/bin/pip install duckdb-cli), or point LLMGW_DUCKDB_CLI at one")
    return subprocess.run([str(CLI), "-readonly", "-bail", str(db)], input=sql, capture_output=True, text=True,
                          env={**os.environ, "TZ": "UTC"}, timeout=60, check=False)


def test_the_duckdb_cli_people_install_opens_the_snapshot(snapshot: Path) -> None:
    version = subprocess.run([str(CLI), "--version"], capture_output=True, text=True, check=False).stdout \
        if CLI.exists() else ""
    assert version.startswith("v1.5."), f"docs/data.md promises the 1.5 CLI; this is {version or 'missing'}"
    done = duckdb_cli(snapshot, "SELECT count(*) FROM events;")
    assert done.returncode == 0, done.stderr
    assert f"{len(history())}" in done.stdout


def test_every_query_in_the_doc_prints_what_the_doc_shows(snapshot: Path) -> None:
    text = DOC.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) >= 8
    outputs = []
    for sql, _ in blocks:
        done = duckdb_cli(snapshot, sql)
        assert done.returncode == 0 and not done.stderr, f"{sql}\n{done.stderr}"
        outputs.append(done.stdout)
    if os.environ.get("LLMGW_UPDATE_DOCS"):
        printed = iter(outputs)
        DOC.write_text(_BLOCK.sub(lambda b: f"```sql\n{b.group(1)}```\n\n```text\n{next(printed)}```\n", text))
        return
    for (sql, shown), out in zip(blocks, outputs, strict=True):
        assert shown, f"docs/data.md shows no output under:\n{sql}"
        assert out == shown, f"docs/data.md shows another output than the CLI prints for:\n{sql}"


def test_every_table_view_and_column_says_what_it_is(snapshot: Path) -> None:
    con = duckdb.connect(str(snapshot), read_only=True)
    try:
        bare = con.execute("SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
                           "AND NOT internal AND (comment IS NULL OR comment = '')").fetchall()
        names = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE comment <> '' UNION "
                                           "SELECT view_name FROM duckdb_views() WHERE NOT internal AND comment <> ''")
                 .fetchall()}
    finally:
        con.close()
    assert bare == []
    assert names == set(schema.TABLES) | set(schema.VIEWS)
    doc = DOC.read_text()
    assert [n for n in names if f"`{n}`" not in doc] == []  # and the doc names each


# --- the views' answers on known histories ---------------------------------------------------------------------


def _project(tmp_path: Path, events: list[m.Event]) -> Store:
    return project(tmp_path / "v.duckdb", events, commit_every=7)


def _later() -> list[m.Event]:
    """small_fleet, then a fault under r-llama, n1's inventory again, and r-llama stopped past midnight."""
    return [
        *small_fleet(),
        m.GpuHealthChanged(at=t(120), node="n2", gpu_index=1, gpu_uuid="GPU-n2-1", healthy=False,
                           reasons=("xid 48: double-bit ECC error",)),
        m.NodeInventoryReported(at=t(130), node="n1", fabric="ib-a", fabric_source="fleet-file", boot_id="boot-n1b",
                                gpus=tuple(m.GpuInfo(index=i, uuid=f"GPU-n1-{i}", name="NVIDIA H100-80GB",
                                                     gpu_class="H100-80GB", memory_mib=81559, healthy=i != 2,
                                                     reasons=("xid-79",) if i == 2 else ("thermal slowdown",) if i == 3
                                                     else ()) for i in range(4))),
        m.ReplicaStopped(at=t(900), replica_id="r-llama", model="llama-70b", reason="idle"),
    ]


def test_idle_intervals_run_from_request_to_request_stop_or_the_newest_event(tmp_path: Path) -> None:
    store = _project(tmp_path, _later())
    try:
        assert store.query("SELECT replica_id, gpu_count, idle_from, idle_to, idle_s, ongoing "
                           "FROM replica_idle_intervals ORDER BY replica_id, idle_from") == [
            ("r-llama", 8, t(9), t(95), 86 * 60.0, False),
            ("r-llama", 8, t(95), t(900), 805 * 60.0, False),  # to its stop
            ("r-qwen", 1, t(7), t(8), 60.0, False),  # rt-a saw a request at 7, rt-b at 8
            ("r-qwen", 1, t(8), t(900), 892 * 60.0, True),  # to the newest event: still idle
        ]  # r-gemma: no router ever reported it, unknown is not idle
    finally:
        store.close()


def test_a_router_starting_later_splits_no_idle_stretch(tmp_path: Path) -> None:
    """A router with a new name (a rolled-out pod) routes to r-qwen from t(500) and is never asked:
    r-qwen stays idle from its last request, as the fold's idle_since says."""
    late = m.IdleMapPublished(at=t(500), router="rt-new", boot_id="new", tick=1, serving_since={"r-qwen": t(500)})
    events = _later()
    store = _project(tmp_path, [*events[:-1], late, events[-1]])
    try:
        assert store.query("SELECT idle_from, idle_to, ongoing FROM replica_idle_intervals "
                           "WHERE replica_id = 'r-qwen' ORDER BY idle_from") == [(t(7), t(8), False), (t(8), t(900), True)]
    finally:
        store.close()


def test_gpu_hours_idle_per_model_and_day_split_at_midnight_utc(tmp_path: Path) -> None:
    store = _project(tmp_path, _later())
    try:
        store.query("SET TimeZone = 'America/New_York'")  # the answer does not depend on the session's zone
        rows = store.query("SELECT model, day, round(gpu_hours_idle, 4) FROM gpu_hours_idle_daily ORDER BY ALL")
    finally:
        store.close()
    # midnight is t(840): r-llama idle 10:09-11:35, 11:35-24:00 and 00:00-01:00 on 8 GPUs; r-qwen 10:08-01:00
    # (r-qwen's 10:07-10:08 is shorter than 30 minutes: busy, not idle)
    assert rows == [
        ("llama-70b", date(2026, 3, 2), round(8 * (86 + 745) / 60, 4)),
        ("llama-70b", date(2026, 3, 3), 8.0),
        ("qwen-8b", date(2026, 3, 2), round(832 / 60, 4)),
        ("qwen-8b", date(2026, 3, 3), 1.0),
    ]


def test_gpu_faults_name_each_new_reason_its_xid_and_the_replica_then(tmp_path: Path) -> None:
    store = _project(tmp_path, _later())
    try:
        rows = store.query("SELECT node, gpu_index, gpu_uuid, ts, kind, xid, reason, healthy, replica_id "
                           "FROM gpu_faults ORDER BY ts, node, gpu_index")
    finally:
        store.close()
    assert rows == [
        ("n1", 2, "GPU-n1-2", t(1), "xid", 79, "xid-79", False, None),
        ("n2", 1, "GPU-n2-1", t(120), "xid", 48, "xid 48: double-bit ECC error", False, "r-llama"),
        # n1's second inventory: xid-79 again is not news; GPU 3's slowdown is (reported by the inventory only)
        ("n1", 3, "GPU-n1-3", t(130), "thermal", None, "thermal slowdown", True, None),
    ]


def test_fault_kinds_are_the_agents_finding_codes(tmp_path: Path) -> None:
    findings = [xid_finding(79), xid_finding(13), GPU_LOST, THERMAL, POWER_BRAKE, ecc_finding(3)]
    events: list[m.Event] = [m.GpuHealthChanged(at=t(i), node="n1", gpu_index=i, gpu_uuid=f"GPU-n1-{i}",
                                                healthy=not f.fatal, reasons=(f.text,)) for i, f in enumerate(findings)]
    store = _project(tmp_path, events)
    try:
        kinds = store.query("SELECT kind, xid FROM gpu_faults ORDER BY gpu_index")
    finally:
        store.close()
    assert kinds == [("xid", 79), ("xid", 13), *((f.code, None) for f in findings[2:])]


def test_lifetimes_and_gpus_of_replicas(tmp_path: Path) -> None:
    store = _project(tmp_path, _later())
    try:
        lives = store.query("SELECT replica_id, nodes, gpu_count, placed_at, stopped_at, stop_reason "
                            "FROM replica_lifetimes ORDER BY replica_id")
        held = store.query("SELECT node, gpu_index, stopped_at FROM replica_gpus WHERE replica_id = 'r-llama' "
                           "ORDER BY ALL")
    finally:
        store.close()
    assert lives == [
        ("r-gemma", ["n4"], 1, t(4), None, None),
        ("r-llama", ["n2", "n3"], 8, t(4), t(900), "idle"),
        ("r-qwen", ["n1"], 1, t(4), None, None),
    ]
    assert held == [(n, i, t(900)) for n in ("n2", "n3") for i in range(4)]


def test_the_docs_history_is_three_days_of_office_hours() -> None:
    """The doc's outputs depend on this history; a change to it shows here first."""
    events = history()
    assert (events[0].at, events[-1].at) == (at(0, 8), at(3, 8))
    assert all(e.at.tzinfo is UTC for e in events)
    assert sum(isinstance(e, m.IdleMapPublished) for e in events) == 2 * 3 * 24 * 30
