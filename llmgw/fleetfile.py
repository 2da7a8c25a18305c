"""The fleet file (TOML): a fleet described without touching one.

Simulated agents run it and the planner plans against it (what-if). Its shape is the
Structs below, decoded by msgspec; what a Struct cannot say (names that repeat, indices
below another field's count) is checked after. Every mistake is reported as one line
naming the file, the field and the value.
"""

from __future__ import annotations

import hashlib
import re
import types
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec
import msgspec.toml
from msgspec import Meta

from llmgw import messages as m
from llmgw.errors import FleetFileError

# A fleet file is read whole by every command that takes one: bounded, so that a
# wrong file (a log, a disk image) is refused at once instead of parsed for minutes.
MAX_BYTES = 8 * 1024 * 1024  # about 60,000 nodes written as in examples/fleet.toml
MAX_NODES = 10_000
_TEN_YEARS_S = 10 * 365 * 86400  # messages.Seconds' bound

# Every field's description is what its error line says it must be: "nodes[0].gpu_count
# must be a positive integer of at most 64 (got 0)". A GPU index is bounded by its node's
# gpu_count after the decode, so that its error can name the number.
_GpuOfNode = Annotated[int, Meta(description="a GPU index from 0 to gpu_count - 1")]


class FleetNode(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``[[nodes]]`` table: one node of the fleet."""

    name: Annotated[m.Name, Meta(description=m.NAME_RULE)]
    fabric: Annotated[m.Fabric, Meta(description=m.FABRIC_RULE)]  # as the inventory decoder takes it: agents publish it
    gpu_class: Annotated[m.GpuClass, Meta(description="a GPU class like H100-80GB (model, '-', memory in GB)")]
    gpu_count: Annotated[int, Meta(ge=1, le=64, description="a positive integer of at most 64")]
    gpu_memory_mib: Annotated[int, Meta(ge=1024, le=4 * 1024 * 1024, description="a whole number of MiB between 1024 and 4194304")]
    unhealthy: Annotated[tuple[_GpuOfNode, ...], Meta(description="an array of GPU indices")] = ()
    gpu_name: Annotated[str, Meta(max_length=200, description="a GPU name of at most 200 characters")] = ""
    # What `vllm --version` says on the node: the planner plans for it.
    vllm_version: Annotated[str, Meta(max_length=100, pattern=r"\A\Z|\d", description='a version such as "0.17.1"')] = ""

    def gpu_uuid(self, index: int) -> str:
        """A stable, UUID-shaped id for a simulated GPU."""
        h = hashlib.blake2b(f"{self.name}/{index}".encode(), digest_size=16).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def default_gpu_name(self) -> str:
        """What NVML would call this GPU: ``NVIDIA H100 80GB``-style; a ``gpu_name`` that does not name
        the file's class by itself (``host memory (simulated card)``) follows it, so that an agent,
        which classes a GPU by its name, reports the class the file says."""
        model, _, mem = self.gpu_class.rpartition("-")
        if not self.gpu_name:
            return f"NVIDIA {model} {mem}"
        names_it = re.match(rf"(?:(?:NVIDIA|Tesla|GeForce|Quadro)\s+)*{re.escape(model)}[\s-]", self.gpu_name, re.I)
        first_gb = re.search(r"(\d+)\s*GB\b", self.gpu_name, re.I)
        if names_it and first_gb and f"{int(first_gb.group(1))}GB" == mem:
            return self.gpu_name
        return f"{model} {mem} ({self.gpu_name})"


class _FaultRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``[[faults]]`` table as written; ``parse`` checks it against the nodes and reads its kind."""

    node: Annotated[str, Meta(description="the name of a node of this file")]
    gpu: Annotated[int, Meta(description="a GPU index of that node, from 0 to its gpu_count - 1")]
    after_s: Annotated[m.Seconds, Meta(description="a number of seconds, from 0 to ten years")]
    kind: Annotated[str, Meta(description="one of xid=N, ecc, lost, thermal, clear")]
    clear_after_s: Annotated[float, Meta(gt=0, le=_TEN_YEARS_S,
                                          description="a number of seconds, more than 0 and at most ten years")] | None = None


class _Document(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole file: its tables."""

    nodes: Annotated[tuple[FleetNode, ...], Meta(min_length=1, max_length=MAX_NODES,
                                                  description=f"an array of 1 to {MAX_NODES:,} tables ([[nodes]])")]
    faults: Annotated[tuple[_FaultRow, ...], Meta(description="an array of tables ([[faults]])")] = ()


# --- [[faults]]: a schedule of injected faults for simulated agents ----------------

FAULT_KINDS = ("xid", "ecc", "lost", "thermal", "clear")


class FaultSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One fault a simulated agent injects ``after_s`` after it starts, optionally cleared later."""

    node: str
    gpu: int
    after_s: float
    kind: str  # xid | ecc | lost | thermal | clear
    xid: int = 0
    clear_after_s: float | None = None


def parse_fault_kind(text: str) -> tuple[str, int]:
    """``xid=79`` → ("xid", 79); ``ecc`` → ("ecc", 0); ValueError says what is accepted."""
    kind, _, arg = text.strip().partition("=")
    if kind == "xid":
        if not re.fullmatch(r"[0-9]{1,3}", arg) or not 0 < int(arg) < 1000:  # not str.isdigit: "²" is a digit to it
            raise ValueError(f"xid needs a number, like xid=79 (got {text!r})")
        return kind, int(arg)
    if kind in FAULT_KINDS and not arg:
        return kind, 0
    raise ValueError(f"must be one of xid=N, ecc, lost, thermal, clear (got {text!r})")


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    """A checked fleet file: its nodes and its fault schedule."""

    path: str
    nodes: tuple[FleetNode, ...]
    schedule: tuple[FaultSpec, ...] = ()  # the [[faults]] tables, checked against the nodes

    def node(self, name: str) -> FleetNode:
        for n in self.nodes:
            if n.name == name:
                return n
        names = ", ".join(n.name for n in self.nodes[:5])
        raise FleetFileError(self.path, "", f"has no node named {name!r} (nodes: {names}{', …' if len(self.nodes) > 5 else ''})")


def faults(fleet: Fleet) -> tuple[FaultSpec, ...]:
    """The validated ``[[faults]]`` schedule of a fleet file (empty when it has none)."""
    return fleet.schedule


# --- reading: the decoder's errors as lines naming file, field and value ----------------


def _shown(value: Any) -> str:
    """A value as an error line shows it: whole when short, else what it is and how long."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else f"{value[:40]!r}… ({len(value):,} characters)"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):  # never repr'd whole: it may be long or nested past repr's recursion limit
        short = len(value) <= 8 and not any(isinstance(v, list | dict) for v in value)
        return repr(value) if short and len(repr(value)) <= 60 else f"an array of {len(value):,}"
    return repr(value)


def _key(key: str) -> str:
    """A key as a field path shows it: bare when TOML would write it bare, else quoted on one line."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]{1,60}", key) else _shown(key)


def _bare(t: Any) -> tuple[Any, str]:
    """The type under Annotated and ``| None``, and the description its Meta gives."""
    description = ""
    while True:
        if get_origin(t) is Annotated:
            t, *metas = get_args(t)
            description = next((x.description for x in metas if isinstance(x, Meta) and x.description), description)
        elif get_origin(t) in (Union, types.UnionType):
            t = next(a for a in get_args(t) if a is not type(None))
        else:
            return t, description


def _wanted(t: Any) -> str:
    bare, description = _bare(t)
    return description or ("a table" if isinstance(bare, type) and issubclass(bare, msgspec.Struct) else "")


def _fields(struct: Any) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(struct)}


_AT = re.compile(r"(?s)(.*?)(?: - at `\$((?:\.\w+|\[\d+\])*)`)?\Z")  # msgspec's "<what> - at `$.nodes[3].gpu_count`"
_MISSING = re.compile(r"Object missing required field `(\w+)`")


def _translated(path: str, doc: dict[str, Any], e: msgspec.ValidationError) -> FleetFileError:
    """The one line for a decoder error: the type and the value at its path give the words."""
    what, at = _AT.fullmatch(str(e)).groups()  # type: ignore[union-attr]  # (?s).*? matches any text
    try:
        return _line(path, doc, what, at or "")
    except (KeyError, IndexError, TypeError, StopIteration):  # a message this reading does not know: shown as it came
        return FleetFileError(path, "", f"does not fit the fleet file format: {e}")


def _line(path: str, doc: dict[str, Any], what: str, at: str) -> FleetFileError:
    t: Any = _Document
    value: Any = doc
    where = ""
    for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", at):
        bare, _ = _bare(t)
        if name:
            t, value = _fields(bare)[name], value[name]
            where = f"{where}.{name}" if where else name
        else:
            t, value = get_args(bare)[0], value[int(index)]
            where = f"{where}[{index}]"
    table, _ = _bare(t)
    if what.startswith("Object contains unknown field"):
        known = _fields(table)
        key = next(k for k in value if k not in known)  # the decoder stops at the first, in the file's order
        return FleetFileError(path, f"{where}.{_key(key)}" if where else _key(key),
                              f"is not a known {'field' if where else 'table'} (known: {', '.join(sorted(known))})")
    if missing := _MISSING.fullmatch(what):
        field = _fields(table)[missing.group(1)]
        where = f"{where}.{missing.group(1)}" if where else missing.group(1)
        bare, _ = _bare(field)
        rows = get_args(bare)[0] if get_origin(bare) is tuple else None
        if isinstance(rows, type) and issubclass(rows, msgspec.Struct):  # a missing table also says how it is written
            return FleetFileError(path, where, f"is missing; it must be {_wanted(field)}")
        return FleetFileError(path, where, "is missing")
    if wanted := _wanted(t):
        return FleetFileError(path, where, f"must be {wanted} (got {_shown(value)})")
    return FleetFileError(path, where, f"is not what a fleet file holds: {what} (got {_shown(value)})")


def parse(text: str, path: str = "<fleet>") -> Fleet:
    """A validated fleet from TOML text."""
    if len(text) > MAX_BYTES:
        raise FleetFileError(path, "", f"is larger than {MAX_BYTES // 2**20} MiB; a fleet file describes at most "
                             f"{MAX_NODES:,} nodes")
    try:
        doc = msgspec.toml.decode(text)  # untyped first: an error line shows the value it names
    except msgspec.DecodeError as e:
        raise FleetFileError(path, "", f"is not valid TOML: {e}") from e
    except RecursionError:  # tomllib's, on arrays or tables nested some hundred deep
        raise FleetFileError(path, "", "is nested too deeply to be a fleet file") from None
    try:
        shape = msgspec.convert(doc, type=_Document)
    except msgspec.ValidationError as e:
        raise _translated(path, doc, e) from e
    nodes: list[FleetNode] = []
    seen: set[str] = set()
    for i, node in enumerate(shape.nodes):
        if node.name in seen:
            raise FleetFileError(path, f"nodes[{i}].name", f"repeats node {node.name!r}")
        seen.add(node.name)
        for j, idx in enumerate(node.unhealthy):
            if not 0 <= idx < node.gpu_count:
                raise FleetFileError(path, f"nodes[{i}].unhealthy[{j}]",
                                     f"must be a GPU index from 0 to {node.gpu_count - 1} (got {idx!r})")
        nodes.append(msgspec.structs.replace(node, unhealthy=tuple(sorted(set(node.unhealthy)))))
    by_name = {n.name: n for n in nodes}
    schedule: list[FaultSpec] = []
    # Every command that reads the file refuses a bad schedule, not only the agent that runs it.
    for i, row in enumerate(shape.faults):
        at = f"faults[{i}]"
        if (of := by_name.get(row.node)) is None:
            raise FleetFileError(path, f"{at}.node", f"names no node of this file (got {_shown(row.node)})")
        if not 0 <= row.gpu < of.gpu_count:
            raise FleetFileError(path, f"{at}.gpu", f"must be a GPU index from 0 to {of.gpu_count - 1} (got {row.gpu!r})")
        try:
            kind, xid = parse_fault_kind(row.kind)
        except ValueError as e:
            raise FleetFileError(path, f"{at}.kind", str(e)) from e
        schedule.append(FaultSpec(node=row.node, gpu=row.gpu, after_s=row.after_s, kind=kind, xid=xid,
                                  clear_after_s=row.clear_after_s))
    return Fleet(path=path, nodes=tuple(nodes), schedule=tuple(schedule))


def load(path: str | Path) -> Fleet:
    """A validated fleet from a file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise FleetFileError(str(path), "", f"is larger than {MAX_BYTES // 2**20} MiB; a fleet file describes at "
                                 f"most {MAX_NODES:,} nodes (see examples/fleet.toml for the format)")
        text = data.decode()
    except FileNotFoundError as e:
        raise FleetFileError(str(path), "", "does not exist; see examples/fleet.toml for the format") from e
    except (OSError, UnicodeDecodeError) as e:
        raise FleetFileError(str(path), "", f"cannot be read: {e}") from e
    return parse(text, str(path))


def inventory(node: FleetNode, at: datetime, boot_id: str = "fleet-file") -> m.NodeInventoryReported:
    """The inventory an agent would report for a node of the file."""
    return m.NodeInventoryReported(
        at=at,
        node=node.name,
        fabric=node.fabric,
        fabric_source="fleet-file",
        boot_id=boot_id,
        simulated=True,
        vllm_version=node.vllm_version,
        gpus=tuple(
            m.GpuInfo(
                index=i,
                uuid=node.gpu_uuid(i),
                name=node.default_gpu_name(),
                gpu_class=node.gpu_class,
                memory_mib=node.gpu_memory_mib,
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                healthy=i not in node.unhealthy,
                reasons=("marked unhealthy in the fleet file",) if i in node.unhealthy else (),
            )
            for i in range(node.gpu_count)
        ),
    )


def inventories(fleet: Fleet, at: datetime) -> list[m.NodeInventoryReported]:
    """Every node's inventory: what the planner folds in what-if mode."""
    return [inventory(n, at) for n in fleet.nodes]
