"""The fleet file (TOML): a fleet described without touching one.

Simulated agents run it and the planner plans against it (what-if). Every
mistake is reported as one line naming the file, the field and the value.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from llmgw import messages as m
from llmgw.errors import FleetFileError

_CLASS = re.compile(m.GPU_CLASS_PATTERN)  # as the inventory decoder takes it: what this file writes, agents publish
# A fleet file is read whole by every command that takes one: bounded, so that a
# wrong file (a log, a disk image) is refused at once instead of parsed for minutes.
MAX_BYTES = 8 * 1024 * 1024  # about 60,000 nodes written as in examples/fleet.toml
MAX_NODES = 10_000
TABLES = ("nodes", "faults")  # the top-level tables a fleet file may hold


@dataclass(frozen=True)
class FleetNode:
    name: str
    fabric: str
    gpu_class: str
    gpu_count: int
    gpu_memory_mib: int
    unhealthy: tuple[int, ...] = ()
    gpu_name: str = ""
    vllm_version: str = ""  # what `vllm --version` says on the node: the planner plans for it

    def gpu_uuid(self, index: int) -> str:
        """A stable, UUID-shaped id for a simulated GPU."""
        h = hashlib.blake2b(f"{self.name}/{index}".encode(), digest_size=16).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def default_gpu_name(self) -> str:
        """What NVML would call this GPU: ``NVIDIA H100 80GB``-style."""
        model, _, mem = self.gpu_class.rpartition("-")
        return self.gpu_name or f"NVIDIA {model} {mem}"


@dataclass(frozen=True)
class Fleet:
    path: str
    nodes: tuple[FleetNode, ...]
    raw: dict[str, Any]  # the whole document, for sections later modules read (faults, …)

    def node(self, name: str) -> FleetNode:
        for n in self.nodes:
            if n.name == name:
                return n
        names = ", ".join(n.name for n in self.nodes[:5])
        raise FleetFileError(self.path, "", f"has no node named {name!r} (nodes: {names}{', …' if len(self.nodes) > 5 else ''})")


def _shown(value: str) -> str:
    """A value as an error line shows it: whole when short, else its start and its length."""
    return repr(value) if len(value) <= 60 else f"{value[:40]!r}… ({len(value):,} characters)"


def _field(path: str, where: str, value: Any, kind: type, problem: str) -> Any:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise FleetFileError(path, where, f"{problem} (got {value!r})")
    if kind is str and not isinstance(value, str):
        raise FleetFileError(path, where, f"{problem} (got {value!r})")
    return value


def parse(text: str, path: str = "<fleet>") -> Fleet:
    """A validated fleet from TOML text."""
    if len(text) > MAX_BYTES:
        raise FleetFileError(path, "", f"is larger than {MAX_BYTES // 2**20} MiB; a fleet file describes at most "
                             f"{MAX_NODES:,} nodes")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FleetFileError(path, "", f"is not valid TOML: {e}") from e
    except RecursionError:
        raise FleetFileError(path, "", "is nested too deeply to be a fleet file") from None
    for key in doc:
        if key not in TABLES:
            raise FleetFileError(path, key, f"is not a known table (known: {', '.join(TABLES)})")
    nodes_raw = doc.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise FleetFileError(path, "nodes", "must be a non-empty array of tables ([[nodes]])")
    if len(nodes_raw) > MAX_NODES:
        raise FleetFileError(path, "nodes", f"lists {len(nodes_raw):,} nodes; a fleet file holds at most {MAX_NODES:,}")
    known = {"name", "fabric", "gpu_class", "gpu_count", "gpu_memory_mib", "unhealthy", "gpu_name", "vllm_version"}
    nodes: list[FleetNode] = []
    seen: set[str] = set()
    for i, raw in enumerate(nodes_raw):
        at = f"nodes[{i}]"
        if not isinstance(raw, dict):
            raise FleetFileError(path, at, "must be a table")
        for key in raw:
            if key not in known:
                raise FleetFileError(path, f"{at}.{key}", f"is not a known field (known: {', '.join(sorted(known))})")
        for key in ("name", "fabric", "gpu_class", "gpu_count", "gpu_memory_mib"):
            if key not in raw:
                raise FleetFileError(path, f"{at}.{key}", "is missing")
        name = _field(path, f"{at}.name", raw["name"], str, "must be a string")
        if (why := m.name_problem(name, "a node name")) is not None:
            raise FleetFileError(path, f"{at}.name", why)
        if name in seen:
            raise FleetFileError(path, f"{at}.name", f"repeats node {name!r}")
        seen.add(name)
        fabric = _field(path, f"{at}.fabric", raw["fabric"], str, "must be a string")
        if m.fabric_problem(fabric) is not None:  # the decoders' rule (messages.Fabric): agents publish it
            raise FleetFileError(path, f"{at}.fabric", f"must be {m.FABRIC_RULE} (got {_shown(fabric)})")
        gpu_class = _field(path, f"{at}.gpu_class", raw["gpu_class"], str, "must be a string")
        if not _CLASS.match(gpu_class):
            raise FleetFileError(path, f"{at}.gpu_class", f"must look like H100-80GB (model, '-', memory in GB) (got {_shown(gpu_class)})")
        count = _field(path, f"{at}.gpu_count", raw["gpu_count"], int, "must be a positive integer")
        if not 1 <= count <= 64:
            raise FleetFileError(path, f"{at}.gpu_count", f"must be a positive integer of at most 64 (got {count!r})")
        mem = _field(path, f"{at}.gpu_memory_mib", raw["gpu_memory_mib"], int, "must be a positive integer (MiB)")
        if not 1024 <= mem <= 4 * 1024 * 1024:
            raise FleetFileError(path, f"{at}.gpu_memory_mib", f"must be between 1024 and 4194304 MiB (got {mem!r})")
        unhealthy_raw = raw.get("unhealthy", [])
        if not isinstance(unhealthy_raw, list):
            raise FleetFileError(path, f"{at}.unhealthy", f"must be an array of GPU indices (got {unhealthy_raw!r})")
        for j, idx in enumerate(unhealthy_raw):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < count:
                raise FleetFileError(path, f"{at}.unhealthy[{j}]", f"must be a GPU index from 0 to {count - 1} (got {idx!r})")
        gpu_name = _field(path, f"{at}.gpu_name", raw.get("gpu_name", ""), str, "must be a string")
        if len(gpu_name) > 200:
            raise FleetFileError(path, f"{at}.gpu_name", f"must be at most 200 characters (got {len(gpu_name):,})")
        vllm_version = _field(path, f"{at}.vllm_version", raw.get("vllm_version", ""), str, "must be a string, e.g. \"0.17.1\"")
        if len(vllm_version) > 100 or (vllm_version and not re.search(r"\d", vllm_version)):
            raise FleetFileError(path, f"{at}.vllm_version", f"must be a version such as \"0.17.1\" (got {_shown(vllm_version)})")
        nodes.append(
            FleetNode(
                name=name,
                fabric=fabric,
                gpu_class=gpu_class,
                gpu_count=count,
                gpu_memory_mib=mem,
                unhealthy=tuple(sorted(set(unhealthy_raw))),
                gpu_name=gpu_name,
                vllm_version=vllm_version,
            )
        )
    fleet = Fleet(path=path, nodes=tuple(nodes), raw=doc)
    faults(fleet)  # every command that reads the file refuses a bad schedule, not only the agent that runs it
    return fleet


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


# --- [[faults]]: a schedule of injected faults for simulated agents ----------------

FAULT_KINDS = ("xid", "ecc", "lost", "thermal", "clear")


@dataclass(frozen=True)
class FaultSpec:
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


def _seconds(path: str, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10 * 365 * 86400:
        raise FleetFileError(path, where, f"must be a number of seconds, from 0 to ten years (got {value!r})")
    return float(value)


def faults(fleet: Fleet) -> tuple[FaultSpec, ...]:
    """The validated ``[[faults]]`` schedule of a fleet file (empty when it has none)."""
    path, raw_list = fleet.path, fleet.raw.get("faults", [])
    if not isinstance(raw_list, list):
        raise FleetFileError(path, "faults", "must be an array of tables ([[faults]])")
    known = {"node", "gpu", "after_s", "kind", "clear_after_s"}
    out: list[FaultSpec] = []
    for i, raw in enumerate(raw_list):
        at = f"faults[{i}]"
        if not isinstance(raw, dict):
            raise FleetFileError(path, at, "must be a table")
        for key in raw:
            if key not in known:
                raise FleetFileError(path, f"{at}.{key}", f"is not a known field (known: {', '.join(sorted(known))})")
        for key in ("node", "gpu", "after_s", "kind"):
            if key not in raw:
                raise FleetFileError(path, f"{at}.{key}", "is missing")
        name = _field(path, f"{at}.node", raw["node"], str, "must be a node name")
        node = next((n for n in fleet.nodes if n.name == name), None)
        if node is None:
            raise FleetFileError(path, f"{at}.node", f"names no node of this file (got {name!r})")
        gpu = raw["gpu"]
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < node.gpu_count:
            raise FleetFileError(path, f"{at}.gpu", f"must be a GPU index from 0 to {node.gpu_count - 1} (got {gpu!r})")
        after = _seconds(path, f"{at}.after_s", raw["after_s"])
        kind_text = _field(path, f"{at}.kind", raw["kind"], str, "must be a string like \"xid=79\"")
        try:
            kind, xid = parse_fault_kind(kind_text)
        except ValueError as e:
            raise FleetFileError(path, f"{at}.kind", str(e)) from e
        clear_after = None
        if "clear_after_s" in raw:
            clear_after = _seconds(path, f"{at}.clear_after_s", raw["clear_after_s"])
            if clear_after <= 0:
                raise FleetFileError(path, f"{at}.clear_after_s", f"must be more than 0 seconds (got {raw['clear_after_s']!r})")
        out.append(FaultSpec(node=name, gpu=gpu, after_s=after, kind=kind, xid=xid, clear_after_s=clear_after))
    return tuple(out)
