"""The one schema: round trips, tags, and messages written by an earlier version."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from llmgw import messages as m
from llmgw import subjects

V1 = Path(__file__).parent / "data" / "events_v1.jsonl"
AT = datetime(2026, 11, 1, 10, 0, tzinfo=UTC)


def test_every_v1_message_still_decodes_with_defaults_for_newer_fields() -> None:
    lines = V1.read_bytes().splitlines()
    events = [m.decode_event(line) for line in lines]
    assert [type(e).__name__ for e in events] == [
        "NodeInventoryReported", "GpuHealthChanged", "NodeLost", "NodeReturned", "HeartbeatSent",
        "IdleMapPublished", "ModelDeclared", "ModelScaled", "ReplicaPlaced", "ReplicaStateChanged",
        "ModelUnplaceable", "ReplicaStopped", "ModelRemoved",
    ]
    inv = events[0]
    assert isinstance(inv, m.NodeInventoryReported)
    # Fields added after v1 was written take their defaults.
    assert inv.gpus[0].healthy is True and inv.gpus[0].pci_bus_id == "" and inv.simulated is False
    idle = events[5]
    assert isinstance(idle, m.IdleMapPublished) and idle.serving_since == {}
    declared = events[6]
    assert isinstance(declared, m.ModelDeclared)
    assert (declared.spec.tp, declared.spec.replicas, declared.spec.gpu_memory_utilization) == (1, 1, 0.9)
    assert all(e.v == 1 for e in events)


def test_a_newer_writer_with_unknown_fields_still_decodes() -> None:
    future = b'{"type":"NodeLost","node":"n1","at":"2026-11-01T10:00:00Z","v":2,"cause":"rack power"}'
    event = m.decode_event(future)
    assert isinstance(event, m.NodeLost) and event.v == 2 and event.node == "n1"


def test_unknown_tag_and_wrong_types_are_decode_errors() -> None:
    with pytest.raises(msgspec.ValidationError):
        m.decode_event(b'{"type":"NodeExploded","node":"n1","at":"2026-11-01T10:00:00Z"}')
    with pytest.raises(msgspec.ValidationError):
        m.decode_event(b'{"type":"NodeLost","node":7,"at":"2026-11-01T10:00:00Z"}')
    with pytest.raises(msgspec.DecodeError):
        m.decode_event(b'{"type":"NodeLost",')


@pytest.mark.parametrize("line", V1.read_bytes().splitlines())
def test_round_trip_and_stream_decoder(line: bytes) -> None:
    event = m.decode_event(line)
    assert m.decode_event(m.encode(event)) == event
    stream = subjects.stream_for_subject(subjects.subject_for(event))
    decoder = {
        subjects.STREAM_FLEET: m.FLEET_DECODER,
        subjects.STREAM_CONTROL: m.CONTROL_DECODER,
        subjects.STREAM_USAGE: m.USAGE_DECODER,
        subjects.STREAM_HEARTBEAT: m.HEARTBEAT_DECODER,
    }[stream]
    assert decoder.decode(line) == event


def test_events_are_frozen() -> None:
    event = m.NodeLost(at=AT, node="n1")
    with pytest.raises(AttributeError):
        event.node = "n2"  # type: ignore[misc]


def test_deep_nesting_is_a_decode_error_readers_catch() -> None:
    """msgspec raises RecursionError, not DecodeError, on deep nesting; DECODE_ERRORS covers both."""
    deep = b'{"type":"NodeLost","node":"n1","at":"2026-11-01T10:00:00Z","junk":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(m.DECODE_ERRORS):
        m.decode_event(deep)


@pytest.mark.parametrize("name, ok", [
    ("meta-llama/Llama-3.1-8B-Instruct", True), ("org/sub/model", True), ("qwen", True),
    ("/model", False), ("org/", False), ("org//model", False), ("org/ model", False), ("a\n/b", False),
])
def test_a_model_name_may_join_parts_with_a_slash_and_a_node_name_may_not(name: str, ok: bool) -> None:
    """OpenAI clients ask for ``org/model``; a node name stays one part (it names files and hosts)."""
    spec = {"name": name, "source": "s", "precision": "bf16", "engine": "vllm", "gpu_class": "H100-80GB",
            "context": 4096}
    if ok:
        assert msgspec.convert(spec, m.ModelSpec).name == name
        assert m.name_problem(name, model=True) is None
    else:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(spec, m.ModelSpec)
        assert m.name_problem(name, model=True) is not None
    assert m.name_problem(name) is None if "/" not in name and ok else m.name_problem(name) is not None
