"""Every decoder that takes bytes from the bus, fed garbage: a decode error or a Struct, nothing else.

Random bytes, truncated messages, wrong types, huge values, deep nesting,
unknown tags and future schema versions. The decoders are collected from
``llmgw.messages`` so a decoder added later is fuzzed too. Also: events carry
no secrets.
"""

from __future__ import annotations

import json
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import fleetfile
from llmgw import messages as m

ROOT = Path(__file__).resolve().parent.parent
AT = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
FLEET = fleetfile.load(ROOT / "examples" / "fleet.toml")

DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    name: obj for name, obj in vars(m).items() if isinstance(obj, msgspec.json.Decoder)
}

SPEC = m.ModelSpec(name="qwen", source="Qwen/Qwen2.5-14B-Instruct", precision="bf16", engine="vllm",
                   gpu_class="H100-80GB", context=32768)
SAMPLES: list[Any] = [
    fleetfile.inventory(FLEET.nodes[2], AT),
    m.GpuHealthChanged(at=AT, node="h100-a-01", gpu_index=3, gpu_uuid="GPU-1", healthy=False, reasons=("xid 79",)),
    m.NodeLost(at=AT, node="h100-a-01", last_heartbeat_at=AT),
    m.NodeReturned(at=AT, node="h100-a-01", boot_id="b2"),
    m.HeartbeatSent(at=AT, node="h100-a-01", boot_id="b", seq=7),
    m.IdleMapPublished(at=AT, router="gw", boot_id="b", tick=3, last_request={"r1": AT}, serving_since={"r2": AT}),
    m.ModelDeclared(at=AT, spec=SPEC),
    m.ModelScaled(at=AT, name="qwen", replicas=3),
    m.ModelRemoved(at=AT, name="qwen"),
    m.ModelUnplaceable(at=AT, name="qwen", reason="no room"),
    m.ReplicaPlaced(at=AT, replica_id="r1", model="qwen", nodes=("h100-a-01",),
                    gpus=(m.GpuRef(node="h100-a-01", index=0, uuid="GPU-0"),), spec=SPEC),
    m.ReplicaStateChanged(at=AT, replica_id="r1", model="qwen", node="h100-a-01", state="healthy", endpoint="http://x"),
    m.ReplicaStopped(at=AT, replica_id="r1", model="qwen", reason="idle"),
]
EVENT_DECODERS: dict[type, str] = {
    m.NodeInventoryReported: "FLEET_DECODER", m.GpuHealthChanged: "FLEET_DECODER", m.NodeLost: "FLEET_DECODER",
    m.NodeReturned: "FLEET_DECODER", m.HeartbeatSent: "HEARTBEAT_DECODER", m.IdleMapPublished: "USAGE_DECODER",
}
DOCS = [json.loads(m.encode(s)) for s in SAMPLES]
if hasattr(m, "PlanRequest"):
    DOCS.append(json.loads(m.encode(m.PlanRequest(model="Qwen/Qwen2.5-14B-Instruct", tp=(1, 2), context=8192))))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)
HUGE = st.sampled_from([10**40, -(10**40), 1e308, "x" * 200_000, [0] * 50_000, {"k" * 1000: 1}, 2**63, -(2**63) - 1])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_all(data: bytes, *, deep: bool = False) -> int:
    """Feed every decoder; return how many accepted. Anything but DecodeError fails the test.

    ``deep``: msgspec raises RecursionError (not DecodeError) at >= ~1000 levels of
    nesting, even inside an unknown field; every consumer must catch both
    (see docs/reliability.md).
    """
    refused: tuple[type[BaseException], ...] = (msgspec.DecodeError, RecursionError) if deep else (msgspec.DecodeError,)
    ok = 0
    for decoder in DECODERS.values():
        try:
            decoder.decode(data)
        except refused:  # ValidationError is a DecodeError
            continue
        ok += 1
    return ok


def test_every_bus_decoder_is_collected() -> None:
    for name in ("ANY_DECODER", "FLEET_DECODER", "HEARTBEAT_DECODER", "USAGE_DECODER", "CONTROL_DECODER", "ERROR_DECODER"):
        assert name in DECODERS
    assert len(DECODERS) >= 6


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    decode_all(data)


@FUZZ
@given(st.sampled_from(range(len(DOCS))), st.data())
def test_truncated_messages_are_refused(i: int, data: st.DataObject) -> None:
    raw = msgspec.json.encode(DOCS[i])
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert decode_all(raw[:cut]) == 0


@FUZZ
@given(st.sampled_from(range(len(DOCS))), st.data(), JSON | HUGE)
def test_wrong_types_and_huge_values(i: int, data: st.DataObject, value: Any) -> None:
    doc = dict(DOCS[i])
    key = data.draw(st.sampled_from(sorted(doc)))
    doc[key] = value
    decode_all(msgspec.json.encode(doc))


@FUZZ
@given(st.sampled_from(range(len(DOCS))), st.text(min_size=1, max_size=30))
def test_unknown_tags_are_refused_by_event_decoders(i: int, tag: str) -> None:
    doc = dict(DOCS[i])
    if "type" not in doc:
        return
    known = {t for s in SAMPLES for t in [type(s).__struct_config__.tag]}
    if tag in known:
        return
    doc["type"] = tag
    raw = msgspec.json.encode(doc)
    for name in ("ANY_DECODER", "FLEET_DECODER", "CONTROL_DECODER", "USAGE_DECODER", "HEARTBEAT_DECODER"):
        with pytest.raises(msgspec.ValidationError):
            DECODERS[name].decode(raw)


@FUZZ
@given(st.sampled_from(range(len(SAMPLES))), st.dictionaries(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12), JSON, max_size=5))
def test_future_schema_versions_decode(i: int, extra: dict[str, Any]) -> None:
    """A v2 writer adds fields with defaults; a v1 reader keeps what it knows and ignores the rest."""
    doc = dict(DOCS[i])
    known = set(doc) | set(type(SAMPLES[i]).__struct_fields__)
    doc.update({k: v for k, v in extra.items() if k not in known})
    doc["v"] = 2
    event = m.decode_event(msgspec.json.encode(doc))
    assert type(event) is type(SAMPLES[i])
    assert event.v == 2
    assert msgspec.structs.replace(event, v=1) == SAMPLES[i]
    stream_decoder = DECODERS.get(EVENT_DECODERS.get(type(SAMPLES[i]), "CONTROL_DECODER"))
    assert stream_decoder is not None and stream_decoder.decode(msgspec.json.encode(doc)) == event


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deep_nesting_is_an_error_not_a_crash(depth: int) -> None:
    for data in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        assert decode_all(data, deep=True) == 0


def test_deep_nesting_in_an_unknown_field_of_a_valid_event() -> None:
    """A 6 KB event: valid except for a deeply nested extra field. It is refused, with an exception a consumer must catch."""
    doc = m.encode(m.NodeLost(at=AT, node="x"))[:-1] + b',"extra":' + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}"
    with pytest.raises(RecursionError):
        m.decode_event(doc)
    shallow = m.encode(m.NodeLost(at=AT, node="x"))[:-1] + b',"extra":' + b'{"a":' * 500 + b"1" + b"}" * 500 + b"}"
    assert m.decode_event(shallow) == m.NodeLost(at=AT, node="x")


def test_idle_map_with_a_million_replicas_decodes() -> None:
    stamp = m.encode(m.IdleMapPublished(at=AT, router="gw", boot_id="b", tick=1, last_request={"r": AT}))
    doc = json.loads(stamp)
    doc["last_request"] = {f"r{i}": "2026-03-01T12:00:00Z" for i in range(200_000)}
    event = m.USAGE_DECODER.decode(msgspec.json.encode(doc))
    assert len(event.last_request) == 200_000


# --- events carry no secrets ---------------------------------------------------------

SECRET_WORDS = ("key", "token", "password", "passwd", "secret", "credential", "auth", "cookie", "bearer")


def secret_like(name: str) -> bool:
    """``api_key``, ``auth_token``, ``passwords``: yes. ``experts_per_token``, ``kv_tokens`` (LLM units): no."""
    words = name.lower().split("_")
    return any(
        (w == s or (w == s + "s" and w != "tokens")) and not (i and words[i - 1] == "per")
        for i, w in enumerate(words) for s in SECRET_WORDS
    )


def test_secret_like() -> None:
    assert [secret_like(n) for n in ("api_key", "auth_token", "password", "node", "experts_per_token", "kv_tokens")] == \
        [True, True, True, False, False, False]


def _field_types(tp: Any, seen: set[type]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for arg in typing.get_args(tp):
        out += _field_types(arg, seen)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and tp not in seen:
        seen.add(tp)
        hints = typing.get_type_hints(tp)
        for name in tp.__struct_fields__:
            out.append((f"{tp.__name__}.{name}", name))
            out += _field_types(hints[name], seen)
    return out


def test_events_carry_no_secrets() -> None:
    """No field of any Struct that travels on the bus is named like a secret: `llmgw replay` output is safe to paste."""
    seen: set[type] = set()
    fields: list[tuple[str, str]] = []
    for obj in vars(m).values():
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
            fields += _field_types(obj, seen)
    assert len(fields) > 50  # the walk reached the nested Structs
    leaks = [qual for qual, name in fields if secret_like(name)]
    # The one secret on the bus on purpose: an engine's API key, on its own stream that only routers
    # (and admin) read (tests/test_natsconf.py). It is no event a reader of every stream decodes, so
    # neither `llmgw replay` nor the projector's DuckDB can ever hold it.
    assert leaks == ["EngineKeyIssued.key"], f"fields that look like secrets travel on the bus: {leaks}"
    issued = m.EngineKeyIssued(at=m.utcnow(), replica_id="r1", node="n1", key="k" * 43, endpoint="http://h:1")
    assert m.EngineKeyIssued not in typing.get_args(m.AnyEvent)
    with pytest.raises(msgspec.ValidationError):
        m.decode_event(msgspec.json.encode(issued))
