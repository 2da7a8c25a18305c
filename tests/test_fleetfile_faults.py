"""The ``[[faults]]`` schedule of a fleet file: parsed, or one line naming file, field and value."""

from __future__ import annotations

import pytest

from llmgw.errors import FleetFileError
from llmgw.fleetfile import FaultSpec, faults, parse, parse_fault_kind

NODES = """
[[nodes]]
name = "n1"
fabric = "ib-a"
gpu_class = "H100-80GB"
gpu_count = 8
gpu_memory_mib = 81559
"""


def _faults(extra: str) -> tuple[FaultSpec, ...]:
    return faults(parse(NODES + extra, "f.toml"))


def test_a_file_without_faults_has_none() -> None:
    assert _faults("") == ()


def test_schedule_is_parsed() -> None:
    got = _faults(
        '[[faults]]\nnode = "n1"\ngpu = 3\nafter_s = 5\nkind = "xid=79"\nclear_after_s = 30\n'
        '[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 0.5\nkind = "ecc"\n'
    )
    assert got == (
        FaultSpec(node="n1", gpu=3, after_s=5.0, kind="xid", xid=79, clear_after_s=30.0),
        FaultSpec(node="n1", gpu=0, after_s=0.5, kind="ecc"),
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[[faults]]\nnode = "n2"\ngpu = 0\nafter_s = 1\nkind = "ecc"\n', "f.toml: faults[0].node names no node of this file (got 'n2')"),
        ('[[faults]]\nnode = "n1"\ngpu = 8\nafter_s = 1\nkind = "ecc"\n', "f.toml: faults[0].gpu must be a GPU index from 0 to 7 (got 8)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = -1\nkind = "ecc"\n', "f.toml: faults[0].after_s must be a number of seconds, from 0 to ten years (got -1)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "melt"\n', "f.toml: faults[0].kind must be one of xid=N, ecc, lost, thermal, clear (got 'melt')"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "xid=x"\n', "f.toml: faults[0].kind xid needs a number, like xid=79 (got 'xid=x')"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "ecc"\nclear_after_s = 0\n', "f.toml: faults[0].clear_after_s must be a number of seconds, more than 0 and at most ten years (got 0)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nkind = "ecc"\n', "f.toml: faults[0].after_s is missing"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "ecc"\nwhen = 2\n', "f.toml: faults[0].when is not a known field (known: after_s, clear_after_s, gpu, kind, node)"),
        ('[[faults]]\nnode = 3\ngpu = 0\nafter_s = 1\nkind = "ecc"\n', "f.toml: faults[0].node must be the name of a node of this file (got 3)"),
        ('[[faults]]\nnode = "n1"\ngpu = "0"\nafter_s = 1\nkind = "ecc"\n', "f.toml: faults[0].gpu must be a GPU index of that node, from 0 to its gpu_count - 1 (got '0')"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = true\nkind = "ecc"\n', "f.toml: faults[0].after_s must be a number of seconds, from 0 to ten years (got True)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = 3\n', "f.toml: faults[0].kind must be one of xid=N, ecc, lost, thermal, clear (got 3)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "ecc"\nclear_after_s = -1\n', "f.toml: faults[0].clear_after_s must be a number of seconds, more than 0 and at most ten years (got -1)"),
    ],
)
def test_bad_schedules_name_file_field_and_value(extra: str, message: str) -> None:
    with pytest.raises(FleetFileError) as e:
        _faults(extra)
    assert str(e.value) == message


def test_faults_must_be_tables() -> None:
    with pytest.raises(FleetFileError) as e:
        faults(parse("faults = 3\n" + NODES, "f.toml"))
    assert str(e.value) == "f.toml: faults must be an array of tables ([[faults]]) (got 3)"
    with pytest.raises(FleetFileError) as e:
        faults(parse("faults = [1]\n" + NODES, "f.toml"))
    assert str(e.value) == "f.toml: faults[0] must be a table (got 1)"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[[faults]]\nnode = "n9"\ngpu = 0\nafter_s = 1\nkind = "ecc"\n', "faults[0].node names no node of this file (got 'n9')"),
        ('[[faults]]\nnode = "n1"\ngpu = 99\nafter_s = 1\nkind = "ecc"\n', "faults[0].gpu must be a GPU index from 0 to 7 (got 99)"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = 1\nkind = "xid=\u00b2"\n', "faults[0].kind xid needs a number"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = nan\nkind = "ecc"\n', "faults[0].after_s must be a number of seconds"),
        ('[[faults]]\nnode = "n1"\ngpu = 0\nafter_s = inf\nkind = "ecc"\n', "faults[0].after_s must be a number of seconds"),
        ('[[fault]]\nnode = "n1"\n', "fault is not a known table (known: faults, nodes)"),
        ('[scheduler]\ntick = 1\n', "scheduler is not a known table (known: faults, nodes)"),
    ],
)
def test_every_reader_of_a_fleet_file_refuses_a_bad_schedule_or_table(extra: str, message: str) -> None:
    """Before: only the simulated agent read [[faults]], and crash-looped on it; planning took the file."""
    with pytest.raises(FleetFileError) as e:
        parse(NODES + extra, "f.toml")
    assert message in str(e.value)


@pytest.mark.parametrize(("text", "parsed"), [("xid=79", ("xid", 79)), ("ecc", ("ecc", 0)), ("lost", ("lost", 0)), ("thermal", ("thermal", 0)), ("clear", ("clear", 0))])
def test_fault_kinds(text: str, parsed: tuple[str, int]) -> None:
    assert parse_fault_kind(text) == parsed


@pytest.mark.parametrize("text", ["xid", "xid=0", "ecc=2", "", "XID=79"])
def test_bad_fault_kinds(text: str) -> None:
    with pytest.raises(ValueError):
        parse_fault_kind(text)
