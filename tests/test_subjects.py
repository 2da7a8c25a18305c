"""Subject builders: one place, node names as tokens, deterministic ids."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from llmgw import messages as m
from llmgw import subjects

AT = datetime(2026, 11, 1, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize("name", ["h100-a-01", "node.cluster.local", "Qwen/Qwen2.5-14B", "a*b>c", "ünï", "x~y"])
def test_token_is_one_safe_token_and_reversible(name: str) -> None:
    tok = subjects.token(name)
    assert "." not in tok and "*" not in tok and ">" not in tok and " " not in tok
    assert subjects.untoken(tok) == name


def test_distinct_names_never_share_a_token() -> None:
    names = ["a.b", "a_b", "a-b", "a~2eb", "a/b"]
    assert len({subjects.token(n) for n in names}) == len(names)


def test_agent_subjects_carry_the_node() -> None:
    inv = m.NodeInventoryReported(at=AT, node="gpu.n1", fabric="f", fabric_source="flag", boot_id="b", gpus=())
    state = m.ReplicaStateChanged(at=AT, replica_id="r1", model="m", node="gpu.n1", state="healthy")
    assert subjects.subject_for(inv) == "llmgw.fleet.gpu~2en1.inventory"
    assert subjects.subject_for(state) == "llmgw.control.replica.r1.state.gpu~2en1"
    assert subjects.stream_for_subject(subjects.subject_for(state)) == subjects.STREAM_CONTROL


def test_msg_id_is_deterministic_and_content_addressed() -> None:
    a = m.NodeLost(at=AT, node="n1")
    b = m.NodeLost(at=AT, node="n2")
    pa, pb = m.encode(a), m.encode(b)
    assert subjects.msg_id(a, pa) == subjects.msg_id(a, m.encode(a))
    assert subjects.msg_id(a, pa) != subjects.msg_id(b, pb)


def test_history_streams_exclude_heartbeats_and_every_stream_is_bounded() -> None:
    assert subjects.STREAM_HEARTBEAT not in subjects.HISTORY_STREAMS
    for spec in subjects.STREAMS:
        assert spec.max_bytes > 0 and spec.duplicate_window_s > 0
    hb = subjects.STREAM_BY_NAME[subjects.STREAM_HEARTBEAT]
    assert hb.max_msgs_per_subject == 1
