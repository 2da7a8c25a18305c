"""Restarts are recorded (issue 43): ``llmgw up``'s own stop and start are control events, so a moment
inside the gap reads the control plane down (no replica healthy) and GPU-hours do not count the gap,
whether the stop was recorded (SIGTERM) or only known from the next start (kill -9)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from live_projector import publish_fresh
from projection_events import inventory, placed, spec, t

from llmgw import messages as m
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.fleet.fold import Checkpoint
from llmgw.fleet.state import apply
from llmgw.fleet.status import report

QWEN = spec("qwen-8b", tp=2)


def history(*, recorded: bool) -> list[m.Event]:
    """A 2-GPU replica from 10:00; the control plane down from 11:00 to 12:00, then up again."""
    started = m.ControlPlaneStarted(at=t(120), boot_id="b2", previous_boot_id="b1",
                                    last_seen=None if recorded else t(60))
    return [m.ControlPlaneStarted(at=t(0), boot_id="b1"), inventory("n1", "ib-a", 2, t(0)),
            m.ModelDeclared(at=t(0), spec=QWEN), placed("qwen-r1", QWEN, [("n1", 0), ("n1", 1)], t(0)),
            m.ReplicaStateChanged(at=t(1), replica_id="qwen-r1", model="qwen-8b", node="n1", state="healthy",
                                  endpoint="http://n1:8000"),
            *([m.ControlPlaneStopped(at=t(60), boot_id="b1", reason="SIGTERM")] if recorded else []),
            started]


def folded(events: list[m.Event]) -> Checkpoint:
    c = Checkpoint()
    for i, e in enumerate(events, 1):
        if isinstance(e, m.ControlEvent.__args__):  # type: ignore[attr-defined]
            c.history.note(i, e)  # type: ignore[arg-type]
        apply(c.state, e, i)
    return c


def test_a_moment_inside_a_recorded_stop_reads_the_control_plane_down() -> None:
    events = history(recorded=True)
    c = folded(events[:-1])  # up to the stop: what --at 11:30 folds
    r = report(c.state, t(90), history=c.history, replicas=True)
    assert (r.control_plane, r.control_plane_since) == ("down", t(60))
    assert r.replicas_by_state == {"down": 1} and r.model_states == {"qwen-8b": "down"}
    (row,) = r.replica_list
    assert (row.state, row.detail) == ("down", "was healthy")
    (s,) = r.model_list
    assert (s.healthy, s.gpu_hours_today) == (0, 2.0)  # 2 GPUs × 10:00–11:00, not to 11:30
    after = folded(events)
    r = report(after.state, t(180), history=after.history)
    assert (r.control_plane, r.control_plane_since, r.model_states) == ("up", t(120), {"qwen-8b": "serving"})
    assert r.model_list[0].gpu_hours_today == 4.0  # 10–11 and 12–13: the gap is not counted


def test_after_a_kill_the_next_start_says_since_when_it_was_down() -> None:
    events = history(recorded=False)
    before = folded(events[:-1])
    start = events[-1]
    assert isinstance(start, m.ControlPlaneStarted)
    assert report(before.state, t(90), history=before.history).control_plane == "up"  # nothing recorded it then
    r = report(before.state, t(90), history=before.history, next_start=start)  # what --at learns from after
    assert (r.control_plane, r.control_plane_since, r.replicas_by_state) == ("down", t(60), {"down": 1})
    assert r.model_list[0].gpu_hours_today == 2.0
    assert report(before.state, t(30), history=before.history, next_start=start).control_plane == "up"
    after = folded([*events, m.ReplicaStopped(at=t(150), replica_id="qwen-r1", model="qwen-8b", reason="idle")])
    assert after.history.gpu_seconds_stopped("qwen-8b", t(0).date()) == 2 * 90 * 60  # 60 + 30 minutes held


def _status_at(settings: Settings, at: datetime) -> dict[str, object]:
    r = CliRunner().invoke(cli, ["ctl", "status", "--at", at.isoformat(), "--json", "--nats-url", settings.nats_url])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_ctl_status_at_a_moment_inside_either_gap_says_the_control_plane_was_down(settings: Settings) -> None:
    """On the bus, where --at cuts by the server's stored time: a recorded stop, then a kill -9."""
    def now() -> datetime:
        time.sleep(0.25)  # a moment the server's clock tells apart from the events around it
        return m.utcnow()

    async def publish(events: list[m.Event]) -> None:
        from llmgw.bus import Bus

        bus = await Bus.connect(settings, "llmgw-test-restarts")
        try:
            for e in events:
                await bus.publish(e)
        finally:
            await bus.close()

    t0 = m.utcnow()
    first = [m.ControlPlaneStarted(at=t0, boot_id="b1"), inventory("n1", "ib-a", 2, t0),
             m.ModelDeclared(at=t0, spec=QWEN), placed("qwen-r1", QWEN, [("n1", 0), ("n1", 1)], t0),
             m.ReplicaStateChanged(at=t0, replica_id="qwen-r1", model="qwen-8b", node="n1", state="healthy",
                                   endpoint="http://n1:8000")]
    asyncio.run(publish_fresh(settings, first))
    serving_at = now()
    asyncio.run(publish([m.ControlPlaneStopped(at=now(), boot_id="b1", reason="SIGTERM")]))
    stopped_at = now()
    asyncio.run(publish([m.ControlPlaneStarted(at=now(), boot_id="b2", previous_boot_id="b1"),
                         m.ReplicaStateChanged(at=m.utcnow(), replica_id="qwen-r1", model="qwen-8b", node="n1",
                                               state="healthy", endpoint="http://n1:8000")]))
    last_seen = now()  # b2 is killed: nothing is published until b3 starts
    killed_at = now()
    asyncio.run(publish([m.ControlPlaneStarted(at=now(), boot_id="b3", previous_boot_id="b2", last_seen=last_seen)]))
    assert _status_at(settings, serving_at)["model_states"] == {"qwen-8b": "serving"}
    for at in (stopped_at, killed_at):
        r = _status_at(settings, at)
        assert (r["control_plane"], r["replicas_by_state"], r["model_states"]) == (
            "down", {"down": 1}, {"qwen-8b": "down"}), at
    r = CliRunner().invoke(cli, ["ctl", "status", "--at", killed_at.isoformat(), "--nats-url", settings.nats_url])
    assert r.exit_code == 0 and "CONTROL PLANE DOWN since " in r.stdout, r.output
    r = CliRunner().invoke(cli, ["replay", "--stream", "control", "--nats-url", settings.nats_url])
    lines = [x.split("  ", 2)[-1].strip() for x in r.stdout.splitlines()]
    assert "control plane b1 STOPPED (SIGTERM): nothing serves and no GPU-hours count until it starts again" in lines
    (b3,) = [x for x in lines if x.startswith("control plane b3 ")]
    assert b3.startswith("control plane b3 started; the one before (b2) stopped unrecorded, last seen "), b3


def test_a_control_plane_event_is_bounded_at_decode() -> None:
    """Like every event: an oversized boot id is refused by the decoder (recorded and skipped by the folds)."""
    with pytest.raises(msgspec.ValidationError, match="boot_id"):
        m.CONTROL_DECODER.decode(m.encode(m.ControlPlaneStarted(at=t(0), boot_id="b" * 300)))


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return "zombie" if stat.rsplit(")", 1)[1].split()[0] == "Z" else "alive"
    except (OSError, IndexError):
        return "zombie"


NODE = """
[[nodes]]
name = "cpu-01"
fabric = "local"
gpu_class = "L4-24GB"
gpu_count = 1
gpu_memory_mib = 23034
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_records_its_stop_and_its_start_and_a_kill_is_known_from_the_next_start(tmp_path: Path) -> None:
    """One bounded run of `up` three times on one data directory: SIGTERM, then kill -9, then up again."""
    import os
    import signal

    from test_e2e import control_events, ok, start_up, stop_up, wait_for

    from llmgw.proc import descendants

    fleet = tmp_path / "fleet.toml"
    fleet.write_text(NODE)

    def plane(url: str, n: int) -> list[dict[str, object]]:
        return wait_for(f"{n} control-plane events", lambda: (
            e if len(e := [x for x in control_events(url) if str(x["type"]).startswith("ControlPlane")]) >= n
            else None))

    up, url = start_up(tmp_path, fleet, "--no-example")
    try:
        (first,) = plane(url, 1)
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest
    up, url = start_up(tmp_path, fleet, "--no-example")
    try:
        _, stop, second = plane(url, 3)
        assert (stop["type"], stop["boot_id"], stop["reason"]) == ("ControlPlaneStopped", first["boot_id"], "SIGTERM")
        assert (second["type"], second["previous_boot_id"], second["last_seen"]) == (
            "ControlPlaneStarted", first["boot_id"], None)
        time.sleep(2.5)  # one alive note written since the start (ALIVE_EVERY_S)
        parts = descendants([up.pid]) - {up.pid}
        assert parts
    finally:
        os.kill(up.pid, signal.SIGKILL)  # kill -9: no time to say anything
        up.wait(10)
        stop_up(up)
    # Its parts die with it: none serves on, holds a port, or outlives the gap the next start records.
    wait_for("up's parts gone with it", lambda: not any(os.path.exists(f"/proc/{p}") and
                                                        "zombie" not in _state(p) for p in parts), within_s=15)
    up, url = start_up(tmp_path, fleet, "--no-example")
    try:
        *_, third = plane(url, 4)
        assert (third["type"], third["previous_boot_id"]) == ("ControlPlaneStarted", second["boot_id"])
        last_seen = datetime.fromisoformat(str(third["last_seen"]))
        assert datetime.fromisoformat(str(second["at"])) < last_seen < datetime.fromisoformat(str(third["at"]))
        # A moment inside the recorded gap: down.
        inside = datetime.fromisoformat(str(stop["at"])) + (
            datetime.fromisoformat(str(second["at"])) - datetime.fromisoformat(str(stop["at"]))) / 2
        report = json.loads(ok(url, "ctl", "status", "--at", inside.isoformat(), "--json"))
        assert report["control_plane"] == "down", report
    finally:
        rest = stop_up(up)
    assert up.returncode == 0, rest


def test_chargeback_and_idle_hours_leave_the_control_planes_outages_out(tmp_path: Path) -> None:
    """DuckDB agrees with the fold: 2 GPUs from 10:00 to 13:00 with the plane down 11:00–12:00 are 4 GPU-hours,
    and idle from 10:01 they are 2 × 119 minutes idle."""
    from analyst_history import project

    for recorded in (True, False):
        events = [*history(recorded=recorded),
                  m.IdleMapPublished(at=t(2), router="rt", boot_id="b", tick=1, serving_since={"qwen-r1": t(1)}),
                  m.ReplicaStopped(at=t(180), replica_id="qwen-r1", model="qwen-8b", reason="idle", code="idle")]
        store = project(tmp_path / f"{recorded}.duckdb", events)
        try:
            assert store.query("SELECT down_from, down_to, boot_id, recorded FROM control_plane_outages") == [
                (t(60), t(120), "b2", recorded)]
            assert store.query("SELECT tenant, round(gpu_hours, 3) FROM chargeback_daily") == [("", 4.0)]
            assert store.query("SELECT round(gpu_hours_idle * 60, 3) FROM gpu_hours_idle_daily") == [(2 * 119.0,)]
        finally:
            store.close()


def _asked_at(events: list[m.Event], at: datetime) -> list[m.Event]:
    """``events`` with a router's map saying qwen-r1 was last asked for at ``at`` (before the gap)."""
    return [*events, m.IdleMapPublished(at=at, router="rt", boot_id="b", tick=1, last_request={"qwen-r1": at})]


def test_idle_time_leaves_the_control_planes_gap_out() -> None:
    """Last asked 10:01, the plane down 11:00–12:00: at 13:00 nobody has asked for 119 minutes, not 179,
    whether the stop was recorded or only the next start's last_seen says so."""
    from llmgw.fleet import idle_rows

    for recorded in (True, False):
        c = folded(_asked_at(history(recorded=recorded), t(1)))
        (row,) = idle_rows(c.state, t(180))
        assert (row.idle_s, row.idle_since) == (119 * 60.0, t(1)), recorded
        assert round(row.gpu_hours_idle, 4) == round(2 * 119 / 60, 4)
        r = report(c.state, t(180), idle_threshold_s=60.0, history=c.history, replicas=True)
        assert [x.idle_s for x in r.idle] == [119 * 60.0] and r.replica_list[0].idle_s == 119 * 60.0
        assert r.model_list[0].idle_s == 119 * 60.0
    # A moment inside a kill -9's gap, which only the next start tells: idle stops where the gap began.
    events = _asked_at(history(recorded=False), t(1))
    before = folded(events[:-2] + events[-1:])
    start = events[-2]
    assert isinstance(start, m.ControlPlaneStarted)
    r = report(before.state, t(90), idle_threshold_s=60.0, history=before.history, next_start=start)
    assert [x.idle_s for x in r.idle] == [59 * 60.0]
    # Inside a recorded stop the idle time stops with it.
    c = folded(_asked_at(history(recorded=True)[:-1], t(1)))
    (row,) = idle_rows(c.state, t(90))
    assert row.idle_s == 59 * 60.0


def test_an_idle_ttl_does_not_stop_a_replica_for_the_time_the_control_plane_was_down() -> None:
    """A 90-minute TTL, last asked 10:01, the plane down 11:00–12:00: at 12:01 the replica has been idle 60
    minutes, so the scheduler that just started keeps it; at 13:31 (90 minutes) it stops it."""
    from llmgw.fleet.demand import SchedulerMemory
    from llmgw.scheduler.placement import decide

    ttl = msgspec.structs.replace(QWEN, idle_ttl_s=90 * 60.0)
    for recorded in (True, False):
        events = [ttl if isinstance(e, m.ModelSpec) else e for e in history(recorded=recorded)]
        events = [m.ModelDeclared(at=e.at, spec=ttl) if isinstance(e, m.ModelDeclared) else e for e in events]
        c = folded(_asked_at(events, t(1)))
        stops = [d.event for d in decide(c.state, SchedulerMemory(), t(121)) if isinstance(d.event, m.ReplicaStopped)]
        assert stops == [], (recorded, stops)
        (stop,) = [d.event for d in decide(c.state, SchedulerMemory(), t(151)) if isinstance(d.event, m.ReplicaStopped)]
        assert stop.code == "idle" and "no request for 5400s" in stop.reason, stop


def test_ctl_idle_leaves_the_gap_out(settings: Settings) -> None:
    """Through the CLI, on the bus: a replica last asked for 3 h ago, the plane down for 1 h of them (kill -9)."""
    from datetime import timedelta

    now = m.utcnow()
    ago = lambda minutes: now - timedelta(minutes=minutes)  # noqa: E731
    events = [m.ControlPlaneStarted(at=ago(181), boot_id="b1"), inventory("n1", "ib-a", 2, ago(181)),
              m.ModelDeclared(at=ago(181), spec=QWEN), placed("qwen-r1", QWEN, [("n1", 0), ("n1", 1)], ago(181)),
              m.ReplicaStateChanged(at=ago(180.5), replica_id="qwen-r1", model="qwen-8b", node="n1",
                                    state="healthy", endpoint="http://n1:8000"),
              m.IdleMapPublished(at=ago(180), router="rt", boot_id="b", tick=1, last_request={"qwen-r1": ago(180)}),
              m.ControlPlaneStarted(at=ago(60), boot_id="b2", previous_boot_id="b1", last_seen=ago(120))]
    asyncio.run(publish_fresh(settings, events))
    r = CliRunner().invoke(cli, ["ctl", "idle", "--older-than", "1m", "--replay", "--json",
                                 "--nats-url", settings.nats_url])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["idle"]
    asked = json.loads(r.stdout)["now"]
    # 3 h less the hour it was down, measured at the command's own now (what it asked at)
    assert row["idle_s"] == round((datetime.fromisoformat(asked) - ago(180)).total_seconds() - 3600, 3), row
