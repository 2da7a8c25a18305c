"""``llmgw replay`` through CliRunner: a readable timeline, filters, JSON lines, bad input kept visible."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from projection_events import small_fleet
from streams import fresh_streams

from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings

BAD = b'{"type":"GpuHealthChanged","at":"2026-03-02T10:30:00Z"}'


async def _publish(settings: Settings) -> None:
    bus = await Bus.connect(settings, "llmgw-test-replay")
    try:
        await fresh_streams(bus)
        for event in small_fleet():
            await bus.publish(event)
        await bus.publish_bytes(subjects.fleet("n3", "health"), BAD, "bad-1")
    finally:
        await bus.close()


@pytest.fixture
def history(settings: Settings) -> Settings:
    asyncio.run(_publish(settings))
    return settings


def _replay(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["replay", "--nats-url", settings.nats_url, *args])
    return result.exit_code, result.output


def test_why_was_a_model_unplaceable(history: Settings) -> None:
    code, out = _replay(history, "--model", "deepseek-v3", "--until", "2026-03-02T10:42")
    assert code == 0, out
    assert out == (
        "2026-03-02 10:03:00  control:4       model deepseek-v3 declared: 1 × H100-80GB tp8 pp4 bf16 (vllm)\n"
        "2026-03-02 10:05:00  control:8       model deepseek-v3 UNPLACEABLE (1 missing): needs 4 whole "
        "H100-80GB nodes on one fabric; ib-a has 0 free, ib-b 0\n"
    )


def test_timeline_merges_streams_in_event_time_and_shows_undecodable(history: Settings) -> None:
    code, out = _replay(history)
    assert code == 0, out
    lines = out.splitlines()
    assert len(lines) == len(small_fleet()) + 1
    assert lines[0] == "2026-03-02 10:00:00  fleet:1         node n1 reported 4 × H100-80GB on fabric ib-a"
    assert lines[6] == "2026-03-02 10:02:00  fleet:7         node n5 LOST (no heartbeat for 60s)"
    assert lines[-2].startswith("2026-03-02 11:40:00  usage:4")
    # An event that cannot be decoded has no event time: it sorts by when the server stored it.
    assert [x for x in lines if "UNDECODABLE" in x] == [lines[-1]]
    assert "fleet:8" in lines[-1] and "llmgw.fleet.n3.health: Object missing required field `node`" in lines[-1]


def test_node_filter_includes_replicas_placed_on_it(history: Settings) -> None:
    code, out = _replay(history, "--node", "n3", "--json")
    assert code == 0, out
    rows = [json.loads(x) for x in out.splitlines()]
    assert [(r["stream"], r["seq"], r["event"]["type"]) for r in rows] == [
        ("LLMGW_FLEET", 3, "NodeInventoryReported"),
        ("LLMGW_CONTROL", 5, "ReplicaPlaced"),
        ("LLMGW_CONTROL", 10, "ReplicaStateChanged"),  # its part on n3, reported by n3
    ]
    assert rows[1]["event"]["nodes"] == ["n2", "n3"]


def test_subject_and_window_filters(history: Settings) -> None:
    code, out = _replay(history, "--subject", "llmgw.control.replica.>", "--since", "2026-03-02T10:05",
                        "--until", "2026-03-02T10:06")
    assert code == 0, out
    assert [x.split("  ")[1].strip() for x in out.splitlines()] == ["control:9", "control:10", "control:11", "control:12"]


def test_nothing_matches(history: Settings) -> None:
    code, out = _replay(history, "--model", "nope")
    assert (code, out) == (0, "no events match; widen --since/--until or drop a filter\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stream", "heartbeat"], "is not a history stream"),
        (["--subject", "foo.>"], "is not an llmgw subject"),
        (["--subject", "llmgw.heartbeat.*"], "heartbeats are not history"),
        (["--since", "last tuesday"], "is not a time"),
    ],
)
def test_mistakes(history: Settings, args: list[str], message: str) -> None:
    code, out = _replay(history, *args)
    assert code == 2 and message in out and "Traceback" not in out
