"""``llmgw export --parquet``: every table as Parquet, read back with DuckDB; a live projector's file via its analysts' copy."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import duckdb
import pytest
from analyst_history import project
from click.testing import CliRunner
from projection_events import small_fleet, t

from llmgw import messages as m
from llmgw.cli.main import cli
from llmgw.projections import schema
from llmgw.projections.store import TABLES


def _later() -> list[m.Event]:
    """small_fleet, a map with the engines' cached tokens, and a GPU fault the next day: two days of history."""
    return [*small_fleet(),
            m.IdleMapPublished(at=t(120), router="rt-a", boot_id="a1", tick=3,
                               cache_use={"r-qwen": m.CacheUse("qwen-8b", 2000, 1500)}),
            m.GpuHealthChanged(at=t(900), node="n2", gpu_index=1, gpu_uuid="GPU-n2-1", healthy=False,
                               reasons=("xid 48: double-bit ECC error", "thermal slowdown"))]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "llmgw.duckdb"
    project(path, _later(), commit_every=5).close()
    return path


def export(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, ["export", *args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_every_table_lands_in_parquet_and_reads_back_the_same(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = export("--parquet", str(out), "--db", str(db))
    assert (code, stderr) == (0, "")
    assert stdout.startswith(f"{out}: {len(TABLES)} tables, ")
    assert sorted(p.name for p in (out / "events").iterdir()) == ["day=2026-03-02", "day=2026-03-03"]
    assert (out / "unprojected_events.parquet").exists() and (out / "gpus.parquet").exists()
    # The views too, as they read at the export: a tool that reads Parquet has no SQL to run them with.
    assert f"and {len(schema.VIEWS)} views" in stdout
    for view in schema.VIEWS:
        assert (out / f"{view}.parquet").exists(), view
    con0 = duckdb.connect()
    assert con0.execute(f"SELECT cached_tokens FROM read_parquet('{out}/prefix_cache_daily.parquet')").fetchall() == [(1500,)]
    con = duckdb.connect(str(db), read_only=True)
    try:
        for table in TABLES:
            where = out / table
            read = (f"read_parquet('{where}/*/*.parquet', hive_partitioning = true)" if where.is_dir()
                    else f"read_parquet('{where}.parquet')")
            cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()]
            if table == "projector_state":  # the projector's resume point stays its own (it holds key secrets)
                assert "checkpoint" not in [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {read}").fetchall()]
                cols.remove("checkpoint")
            mine = sorted(con.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall(), key=repr)
            theirs = sorted(con.execute(f"SELECT {', '.join(cols)} FROM {read}").fetchall(), key=repr)
            assert theirs == mine, table
        # the day is the event's, in UTC, and lists stay lists
        assert con.execute(f"SELECT day, reasons FROM read_parquet('{out}/gpu_health/*/*.parquet', "
                           "hive_partitioning = true) ORDER BY ts").fetchall() == [
            (date(2026, 3, 2), ["xid-79"]), (date(2026, 3, 3), ["xid 48: double-bit ECC error", "thermal slowdown"])]
    finally:
        con.close()


def test_a_directory_with_files_in_it_is_refused_and_kept(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, _, stderr = export("--parquet", str(out), "--db", str(db))
    assert code == 1
    assert stderr == f"Error: {out} exists and is not an empty directory; choose a new one (the export writes a whole tree)\n"
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


@contextlib.contextmanager
def held(db: Path) -> Iterator[None]:
    """``db`` open in another process, as a running projector holds it."""
    code = ("import sys; from llmgw.projections.store import Store; s = Store(sys.argv[1]); print('open', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "open\n"
        yield
    finally:
        proc.communicate("", timeout=30)


@pytest.mark.parametrize("name", ["llmgw.analysts.duckdb", "llmgw.snapshot.duckdb"])  # and the name before schema 5
def test_a_file_a_projector_holds_is_exported_from_its_analysts_copy(db: Path, tmp_path: Path, name: str) -> None:
    project(tmp_path / "other.duckdb", small_fleet()[:5]).export_copy(tmp_path / name)
    with_copy = tmp_path / "a"
    with held(db):
        code, stdout, stderr = export("--parquet", str(with_copy), "--db", str(db))
        assert code == 0
        assert stderr == (f"{db} is held by a running projector: exported its analysts' copy "
                          f"{tmp_path / name}\n")
    con = duckdb.connect()
    assert con.execute(f"SELECT count(*) FROM read_parquet('{with_copy}/events/*/*.parquet')").fetchone() == (5,)


def test_a_held_file_without_an_analysts_copy_is_an_error_with_the_next_step(db: Path, tmp_path: Path) -> None:
    with held(db):
        code, stdout, stderr = export("--parquet", str(tmp_path / "b"), "--db", str(db))
    assert (code, stdout) == (1, "")
    assert stderr.startswith(f"Error: {db} is held by a running projector and has no analysts' copy")
    assert "llmgw project --once --db mine.duckdb && llmgw export --parquet" in stderr
    assert not (tmp_path / "b").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_data_dir_up_used_is_where_export_looks(db: Path, tmp_path: Path) -> None:
    """`up --data-dir X` keeps llmgw.duckdb in X; export finds it there by --data-dir (or LLMGW_DATA_DIR)."""
    code, stdout, stderr = export("--parquet", str(tmp_path / "out"), "--data-dir", str(db.parent))
    assert (code, stderr) == (0, "") and f"(from {db})" in stdout
    r = CliRunner().invoke(cli, ["export", "--parquet", str(tmp_path / "out2")], env={"LLMGW_DATA_DIR": str(db.parent)})
    assert r.exit_code == 0 and f"(from {db})" in r.stdout
