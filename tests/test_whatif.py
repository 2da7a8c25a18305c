"""``ctl what-if``: the recorded policy re-decided reproduces what happened; other policies cost what a hand count says.

Histories come from ``whatif_world``: the real scheduler deciding over requests, a router and
agents in virtual time. The pure part is fed here as the bus reader feeds it; the CLI runs
against a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from whatif_world import T0, every, history, inventory, spec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.ctl import first_stored
from llmgw.fleet.fold import Checkpoint, fold_batch
from llmgw.whatif.policies import Outcome, Policy, Replay
from llmgw.whatif.window import WINDOW_KEEPS


class _At:
    __slots__ = ("seq", "subject", "ts_ns")

    def __init__(self, seq: int, subject: str, at: datetime) -> None:
        self.seq, self.subject, self.ts_ns = seq, subject, int(at.timestamp() * 1e9)


def replayed(events: list[tuple[str, m.Event]], since: datetime, until: datetime, policies: list[Policy],
             extra: tuple[m.NodeInventoryReported, ...] = ()) -> Outcome:
    """What ``what_if`` does with the streams, fed from a list: fold up to ``since``, then every policy."""
    c = Checkpoint()
    seqs = dict.fromkeys(subjects.HISTORY_STREAMS, 0)
    run: Replay | None = None
    for stream, event in events:
        seqs[stream] += 1
        subject = subjects.usage_idle(event.router) if type(event) is m.IdleMapPublished else \
            subjects.subject_for(event)  # type: ignore[attr-defined]
        at = _At(seqs[stream], subject, event.at)
        if event.at <= since:
            fold_batch(c, stream, [at], [event])
            continue
        if event.at > until:
            break
        if run is None:
            run = Replay(c, policies, since, extra)
        assert fold_batch(c, stream, [at], [event], keep=WINDOW_KEEPS) == [None]
        run.feed(stream, event)
    assert run is not None
    return run.finish(until)


def busy_day() -> list[tuple[str, m.Event]]:
    """Three hours of three models: one parked between bursts, one autoscaled with load, one always on."""
    requests = [*every("bursty", 300, 900, 20), *every("bursty", 4000, 4300, 15), *every("bursty", 8000, 8100, 30),
                *every("auto", 600, 2400, 0.4), *every("auto", 6000, 6300, 5),
                *every("steady", 100, 10_000, 45)]
    requests.sort()
    specs = [spec("bursty", ttl=600.0), spec("auto", lo=0, hi=3, target=1.0), spec("steady")]
    return history(specs, requests, hours=3)


@pytest.fixture(scope="module")
def day() -> list[tuple[str, m.Event]]:
    return busy_day()


def test_the_recorded_policy_re_decided_reproduces_the_history(day: list[tuple[str, m.Event]]) -> None:
    placed = [e for _, e in day if type(e) is m.ReplicaPlaced]
    causes = {e.cause for e in placed}
    assert {"wake", "scale-up", ""} <= causes  # wakes, scale-ups and deploys all happened
    out = replayed(day, T0 + timedelta(seconds=30), T0 + timedelta(hours=3), [])
    assert out.recorded_decisions >= 12
    assert out.reproduced >= 0.99, (out.matched, out.recorded_decisions)
    assert out.gpu_hours_diff is not None and abs(out.gpu_hours_diff) <= 0.02
    assert out.replayed_total.cold_starts == out.recorded_total.cold_starts


def test_from_the_middle_of_the_history_too(day: list[tuple[str, m.Event]]) -> None:
    out = replayed(day, T0 + timedelta(seconds=3900), T0 + timedelta(hours=3), [])
    assert out.recorded_decisions >= 5
    assert out.reproduced >= 0.99, (out.matched, out.recorded_decisions)
    assert out.gpu_hours_diff is not None and abs(out.gpu_hours_diff) <= 0.02


# One model, one replica kept up (no TTL), requests at 10, 40 and 116 min 40 s; a 2 s engine start.
LONE = [(600.0, "lone"), (2400.0, "lone"), (7000.0, "lone")]


def _lone(ttl: str, seconds: float | None) -> Policy:
    return Policy(label=ttl, idle_ttl=(("", seconds),))


def test_a_shorter_ttl_holds_fewer_gpu_hours_and_wakes_more_by_the_hand_count() -> None:
    events = history([spec("lone")], LONE, hours=3)
    since, until = T0 + timedelta(seconds=60), T0 + timedelta(hours=3)
    out = replayed(events, since, until, [_lone("15m", 900.0), _lone("1h", 3600.0), _lone("never", None)])
    short, hour, never = (out.asked_total[x] for x in ("15m", "1h", "never"))
    # 15m: up until 600+900 s; woken at 2400 (the scheduler 50 ms on, healthy 2 s later), idle from
    # healthy, stopped 900 s on; the same at 7000. GPU-seconds 1440 + 902 + 902.
    assert short.gpu_hours == round((1440 + 902 + 902) / 3600, 3)
    assert (short.cold_starts, short.waited_requests, short.added_wait_s_p50) == (2, 2, 2.05)
    # 1h: up until 2400+3600 s, woken at 7000, stopped an hour after it was healthy.
    assert hour.gpu_hours == round((5940 + 3602) / 3600, 3)
    assert (hour.cold_starts, hour.waited_requests) == (1, 1)
    # never: up the whole window, as recorded.
    assert never.gpu_hours == out.recorded_total.gpu_hours == round(10_740 / 3600, 3)
    assert (never.cold_starts, never.waited_requests) == (0, 0)
    assert short.gpu_hours < hour.gpu_hours < never.gpu_hours
    assert short.cold_starts > hour.cold_starts > never.cold_starts
    assert short.idle_gpu_hours < hour.idle_gpu_hours < never.idle_gpu_hours
    assert out.reproduced == 1.0


def test_autoscaling_a_fixed_model_from_zero_trades_gpu_hours_for_waits() -> None:
    events = history([spec("lone")], LONE, hours=3)
    out = replayed(events, T0 + timedelta(seconds=60), T0 + timedelta(hours=3),
                   [Policy(label="0-1", min_replicas=0, max_replicas=1)])
    asked = out.asked_total["0-1"]
    assert asked.gpu_hours < out.recorded_total.gpu_hours
    assert asked.cold_starts >= 3 and asked.waited_requests == 3  # each request woke it: it scales to 0 in 5 min


def test_nodes_from_a_fleet_file_place_what_did_not_fit() -> None:
    events = history([spec("a"), spec("b")], [], hours=1, nodes=1, gpus=1)
    assert any(type(e) is m.ModelUnplaceable for _, e in events)
    got = replayed(events, T0 + timedelta(seconds=60), T0 + timedelta(hours=1),
                   [Policy(label="+1 node", idle_ttl=(("", None),))], (inventory("extra-0", 1, T0),))
    assert got.recorded_total.unplaceable_minutes == 59.0 and got.recorded_total.gpu_hours == round(59 / 60, 3)
    asked = got.asked_total["+1 node"]
    assert asked.unplaceable_minutes < 0.1 and asked.gpu_hours > 1.9  # both models run from a second on
    assert got.reproduced == 1.0 and got.gpu_hours_diff == 0.0  # the recorded replay did not get the node


# One node, two 80 GB cards; four small llama.cpp models (10 GiB each): a, b and c at T0, d declared at 30 min,
# a removed at 40 min. Packed, all run on one card; whole GPUs serve two at a time.
CARD_MIB = 81559
SMALL_MIB = 10 * 1024
PACK_LATER: list[tuple[float, m.ModelSpec | str]] = [(1800.0, spec("d", gib=10.0)), (2400.0, "a")]


def _pack_world() -> list[tuple[str, m.Event]]:
    return history([spec(x, gib=10.0) for x in "abc"], [], hours=1, later=PACK_LATER, nodes=1, gpus=2)


def _pack(**kw: object) -> list[Policy]:
    return [Policy(label="packing", **kw), Policy(label="whole GPUs", exclusive=True, **kw)]  # type: ignore[arg-type]


def test_packing_holds_fewer_gpu_hours_and_leaves_nothing_unplaceable_where_whole_gpus_do() -> None:
    events = _pack_world()
    placed = [e for _, e in events if type(e) is m.ReplicaPlaced]
    assert [e.model for e in placed] == ["a", "b", "c", "d"]
    assert {(g.node, g.index, g.mib) for e in placed for g in e.gpus} == {("n0", 0, SMALL_MIB)}  # one card, shared
    out = replayed(events, T0, T0 + timedelta(hours=1), _pack())
    packing, whole = out.asked_total["packing"], out.asked_total["whole GPUs"]
    # Each policy decides 50 ms after what it acts on: the first pass at T0 + 0.05 s, d's at 1800.05,
    # a's removal at 2400.05 (a stops; whole GPUs place c on its card in the same pass).
    first, a_end, d_at, end = 0.05, 2400.05, 1800.05, 3600.0
    # Packing: card 0 from the first pass to the end; 10 GiB for each replica while it runs.
    assert packing.gpu_hours == round((end - first) / 3600, 3)
    assert packing.booked_gib_hours == round(10 * ((a_end - first) + 2 * (end - first) + (end - d_at)) / 3600, 3)
    assert (packing.unplaceable_minutes, packing.replicas_placed) == (0.0, 4)
    # Whole GPUs: a and b take a card each, c waits for a's card (until a is removed), d waits to the end.
    assert whole.gpu_hours == round(2 * (end - first) / 3600, 3)
    assert whole.booked_gib_hours == round(CARD_MIB / 1024 * ((a_end - first) + (end - first) + (end - a_end))
                                           / 3600, 3)
    assert whole.unplaceable_minutes == round(((a_end - first) + (end - d_at)) / 60, 2)
    assert whole.replicas_placed == 3
    assert packing.gpu_hours < whole.gpu_hours and packing.unplaceable_minutes < whole.unplaceable_minutes
    # Per model: c waited 40 minutes for a card under whole GPUs, none packed.
    assert out.asked["whole GPUs"]["c"].unplaceable_minutes == 40.0 and out.asked["packing"]["c"].unplaceable_minutes == 0
    # The recorded history was made by the packing scheduler: the re-decided one reproduces it.
    assert out.reproduced == 1.0 and out.recorded_total.gpu_hours == packing.gpu_hours
    assert out.whole_start == {"whole GPUs": (0, 0)}


def test_whole_gpus_from_the_middle_place_the_running_replicas_again_and_stop_those_without_a_card() -> None:
    since, end = 600.0, 3600.0
    out = replayed(_pack_world(), T0 + timedelta(seconds=since), T0 + timedelta(hours=1), _pack())
    packing, whole = out.asked_total["packing"], out.asked_total["whole GPUs"]
    # a, b, c ran packed on card 0 at 10 min: whole GPUs put a and b on a card each there, and c nowhere.
    assert out.whole_start == {"whole GPUs": (2, 1)}
    assert packing.gpu_hours == round((end - since) / 3600, 3)
    assert whole.gpu_hours == round(2 * (end - since) / 3600, 3)
    # c from the first pass after 10 min until a's card is free at 40 min; d from 30 min to the end.
    assert whole.unplaceable_minutes == round(((2400.05 - 600.05) + (end - 1800.05)) / 60, 2)
    assert (packing.replicas_placed, whole.replicas_placed) == (1, 1)  # packed d; whole GPUs c, on a's card
    assert out.reproduced == 1.0


def test_whole_gpus_for_one_model_move_only_its_replicas() -> None:
    since, end = 600.0, 3600.0
    out = replayed(_pack_world(), T0 + timedelta(seconds=since), T0 + timedelta(hours=1),
                   _pack(models=frozenset({"c"})))
    whole = out.asked_total["whole GPUs"]
    assert out.whole_start == {"whole GPUs": (1, 0)}  # c to the card a and b leave whole; they stay packed
    assert whole.gpu_hours == round(2 * (end - since) / 3600, 3) and whole.unplaceable_minutes == 0.0
    assert out.asked["whole GPUs"]["c"].booked_gib_hours == round(CARD_MIB / 1024 * (end - since) / 3600, 3)
    assert out.asked["whole GPUs"]["d"].booked_gib_hours == out.asked["packing"]["d"].booked_gib_hours


def test_a_card_two_replicas_share_counts_once_and_stays_held_until_the_last_leaves() -> None:
    """The meter's GPU-hours are the union over the replicas on a card, not their sum."""
    events = history([spec("a", gib=10.0), spec("b", gib=10.0)], [], hours=1, later=[(1200.0, "a")], nodes=1, gpus=2)
    out = replayed(events, T0, T0 + timedelta(hours=1), _pack())
    packing = out.asked_total["packing"]
    assert packing.gpu_hours == round((3600 - 0.05) / 3600, 3)  # b holds the card on after a leaves
    assert out.asked["packing"]["a"].gpu_hours == round((1200.05 - 0.05) / 3600, 3)
    assert packing.booked_gib_hours == round(10 * ((1200.05 - 0.05) + (3600 - 0.05)) / 3600, 3)


# --- the CLI, against the streams ------------------------------------------------------------------------------


async def _publish(bus: Bus, events: list[tuple[str, m.Event]]) -> datetime:
    for _, event in events:
        await bus.publish(event)
    first = await first_stored(bus)
    assert first is not None
    return first


def _cli(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ctl", "what-if", *args, "--nats-url", settings.nats_url])
    return result.exit_code, result.output


async def test_a_sweep_from_the_streams_answers_side_by_side(bus: Bus, settings: Settings) -> None:
    first = await _publish(bus, history([spec("lone")], LONE, hours=3))
    since = first.isoformat()
    code, out = await asyncio.to_thread(_cli, settings, "--since", since, "--idle-ttl", "15m,1h,never", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert [a["policy"] for a in report["asked"]] == ["idle-ttl 15m", "idle-ttl 1h", "idle-ttl never"]
    hours = [a["total"]["gpu_hours"] for a in report["asked"]]
    assert hours == sorted(hours) and hours[0] < hours[-1]
    assert [a["total"]["cold_starts"] for a in report["asked"]] == [2, 1, 0]
    assert report["fidelity"]["reproduced"] >= 0.99 and report["fidelity"]["trusted"]
    assert set(report["recorded"]["total"]) == {"gpu_hours", "booked_gib_hours", "idle_gpu_hours", "cold_starts",
                                                "waited_requests", "added_wait_s_p50", "added_wait_s_p95",
                                                "unplaceable_minutes", "replicas_placed"}
    code, table = await asyncio.to_thread(_cli, settings, "--since", since, "--idle-ttl", "15m", "--model", "lone")
    assert code == 0, table
    assert "fidelity: 100.0% of" in table and "idle-ttl 15m" in table and "cold starts" in table
    assert "WARNING" not in table


async def test_bad_windows_and_knobs_are_refused_with_the_reason(bus: Bus, settings: Settings) -> None:
    first = await _publish(bus, history([spec("lone")], LONE[:1], hours=0.5))
    since = first.isoformat()
    cases = [
        (("--since", since, "--until", since, "--idle-ttl", "15m"), "the window is empty"),
        (("--since", since, "--model", "nobody", "--idle-ttl", "15m"), "no model named 'nobody' was ever declared"),
        (("--since", since, "--idle-ttl", "0"), "an idle TTL of 0 stops nothing"),
        (("--since", since, "--idle-ttl", "3650d"), "ten years is no TTL"),
        (("--since", since, "--idle-ttl", "5m,1h", "--idle-ttl", "lone=1m,2m"), "only one --idle-ttl may list"),
        (("--since", since), "ask something"),
        (("--since", since, "--pack", "--idle-ttl", "15m"), "--pack compares placement alone"),
        (("--since", since, "--until", "2h", "--idle-ttl", "15m"), "the window is empty"),
        (("--since", since, "--until", "2099-01-01", "--idle-ttl", "15m"), "is in the future"),
    ]
    for args, said in cases:
        code, out = await asyncio.to_thread(_cli, settings, *args)
        assert code != 0 and said in out, (args, out)
        assert "Traceback" not in out
    # A window that starts before the history starts where it does, and says so (issue 43, finding 1:
    # `--since 1h` was refused, and so was the time the refusal suggested, truncated to the second).
    code, out = await asyncio.to_thread(_cli, settings, "--since", (first - timedelta(days=1)).isoformat(),
                                        "--idle-ttl", "15m")
    assert code == 0 and "the window starts there" in out, out


async def test_pack_from_the_streams_puts_packing_beside_whole_gpus(bus: Bus, settings: Settings) -> None:
    first = await _publish(bus, _pack_world())
    # One window for both runs (without --until each ends when it asks): the table shows the JSON's figures.
    window = ("--since", first.isoformat(), "--until", datetime.now(UTC).isoformat(), "--pack")
    code, out = await asyncio.to_thread(_cli, settings, *window, "--json")
    assert code == 0, out
    report = json.loads(out)
    packing, whole = (a["total"] for a in report["asked"])
    assert [a["policy"] for a in report["asked"]] == ["packing", "whole GPUs"]
    assert packing["gpu_hours"] < whole["gpu_hours"] and packing["unplaceable_minutes"] < whole["unplaceable_minutes"]
    assert (packing["replicas_placed"], whole["replicas_placed"]) == (4, 3)
    # Every policy starts from the fold at --since, not from one a window of stored events ahead of it
    # (which had the recorded placements counted twice and a whole-GPU start with replicas running).
    assert report["recorded"]["total"]["replicas_placed"] == 4 and report["fidelity"]["reproduced"] == 1.0
    assert not [n for n in report["notes"] if "ran at the window's start" in n]
    code, table = await asyncio.to_thread(_cli, settings, *window)
    assert code == 0, table
    rows = {line.split("  ")[1].strip(): line.split() for line in table.splitlines() if line.startswith("  ")}
    assert rows["replicas placed"][-3:] == ["4", "4", "3"]  # recorded, packing, whole GPUs
    assert rows["GiB-hours booked"][-2:] == [f"{packing['booked_gib_hours']:,.2f}", f"{whole['booked_gib_hours']:,.2f}"]
    assert "Per model: GPU-h held / GiB-h booked / min unplaceable" in table


async def test_every_policy_starts_from_the_fold_at_since_not_a_window_of_events_ahead(bus: Bus,
                                                                                       settings: Settings) -> None:
    """The streams are read in windows of stored time, each folded whole before its events are fed one by one:
    a replica placed in the first window is not also running at the start (it would be placed twice)."""
    a = spec("a", gib=10.0)
    gpu = m.GpuRef(node="n0", index=0, uuid="GPU-n0-0", mib=10240)
    first = await _publish(bus, [(subjects.STREAM_CONTROL, m.ModelDeclared(at=T0, spec=a)),
                                 (subjects.STREAM_CONTROL, m.ReplicaPlaced(at=T0 + timedelta(seconds=1), replica_id="a-r1",
                                                                           model="a", nodes=("n0",), gpus=(gpu,), spec=a))])
    window = ("--since", first.isoformat(), "--until", datetime.now(UTC).isoformat(), "--pack", "--json")
    code, out = await asyncio.to_thread(_cli, settings, *window)
    assert code == 0, out
    report = json.loads(out)
    assert report["recorded"]["total"]["replicas_placed"] == 1, report["recorded"]


async def test_a_window_whose_usage_aged_out_starts_where_the_usage_does_and_says_so(bus: Bus,
                                                                                      settings: Settings) -> None:
    events = history([spec("lone")], LONE, hours=3)
    first = await _publish(bus, events)
    usage = await bus.stream_last_seq(subjects.STREAM_USAGE)
    await bus.js.purge_stream(subjects.STREAM_USAGE, seq=usage // 2)  # what the 30-day retention does to old usage
    code, out = await asyncio.to_thread(_cli, settings, "--since", first.isoformat(), "--idle-ttl", "15m", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert any(n.startswith("the usage stream no longer holds demand before") for n in report["notes"])
    assert report["since"] > "2026-03-02T01:"  # about half the 3 hours gone: the figures start there
    since, until = (datetime.fromisoformat(report[k]) for k in ("since", "until"))
    held = (until - since).total_seconds() / 3600  # the one replica, up all along: only the window's part counts
    assert abs(report["recorded"]["total"]["gpu_hours"] - held) < 0.01


@pytest.mark.parametrize("recorded", [True, False])
def test_gpu_hours_and_idle_leave_a_control_plane_gap_out(recorded: bool) -> None:
    """LONE with the control plane down from 1 h to 1 h 30 (a recorded stop, or a kill -9 that the next start's
    last_seen tells): nothing in the gap was stored, and no policy holds or idles GPU-hours in it."""
    down, up = T0 + timedelta(hours=1), T0 + timedelta(hours=1, minutes=30)
    events = [(s, e) for s, e in history([spec("lone")], LONE, hours=3) if not down <= e.at < up]
    start = m.ControlPlaneStarted(at=up, boot_id="b2", previous_boot_id="b1", last_seen=None if recorded else down)
    cut = next(i for i, (_, e) in enumerate(events) if e.at >= up)
    events[cut:cut] = [*([(subjects.STREAM_CONTROL, m.ControlPlaneStopped(at=down, boot_id="b1"))] if recorded else []),
                       (subjects.STREAM_CONTROL, start)]
    since, until = T0 + timedelta(seconds=60), T0 + timedelta(hours=3)
    out = replayed(events, since, until, [_lone("never", None), _lone("15m", 900.0), _lone("1h", 3600.0)])
    whole = replayed(history([spec("lone")], LONE, hours=3), since, until, [_lone("never", None)])
    never = out.asked_total["never"]
    assert never.gpu_hours == out.recorded_total.gpu_hours == round((10_740 - 1800) / 3600, 3)
    # Idle from 2400 s to 7000 s: the half hour down inside it is not idle (of the 0.9 of its card vLLM books).
    assert out.recorded_total.idle_gpu_hours == never.idle_gpu_hours == round(
        whole.recorded_total.idle_gpu_hours - 0.5 * 0.9, 3)
    # 15m: stopped at 1500 s and woken at 2400, it would idle-stop at 3302, before the gap: as without one.
    assert out.asked_total["15m"].gpu_hours == round((1440 + 902 + 902) / 3600, 3)
    # 1h: idle from 2400 s, 20 minutes of it before the gap and 40 after would be 7800 s, but 7000 asks first,
    # so it stops only an hour after that, at 10,600 s, and never wakes (without the gap left out it stopped at
    # 6000 and woke at 7000).
    hour = out.asked_total["1h"]
    assert (hour.gpu_hours, hour.cold_starts) == (round((10_740 - 1800 - 200) / 3600, 3), 0)
