"""The bounds every number and string is decoded under, and the root ``Event``."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

import msgspec

SCHEMA_VERSION = 1

# --- bounds: every number and string a decoder accepts -----------------------------
#
# One event out of range must never stop a reader: the projector's DuckDB columns
# (INTEGER, BIGINT), its msgpack checkpoint (64-bit integers) and the scheduler's
# loops all have limits, so every integer and string is bounded here, where bytes
# become Structs; an event outside is refused by the decoder, recorded and skipped.

# Names (nodes, models, routers; a replica id is a model name + ``-rN``): 1 to 128
# letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit. No space,
# newline or other character a subject token, a shell or a table would mangle. A model
# name (and so a replica id) may also have ``/`` between parts: ``org/model``, as Hugging
# Face and OpenAI clients write the model they ask for. Subjects and file names carry
# names through ``subjects.token``, which encodes what is not a letter, digit, _ or -.
NAME_MAX = 128
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"  # \Z: "$" would let a trailing newline through
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*\Z"
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=MODEL_NAME_PATTERN)]
NAME_RULE = f"1 to {NAME_MAX} letters, digits, '.', '_' or '-', starting with a letter or digit"
MODEL_NAME_RULE = f"{NAME_RULE}, or such parts joined by '/' (org/model)"
_NAME = re.compile(NAME_PATTERN)
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)


def name_problem(name: str, what: str = "a name", *, model: bool = False) -> str | None:
    """Why ``name`` breaks the names rule (for an error message), or None when it follows it."""
    if len(name) <= NAME_MAX and (_MODEL_NAME if model else _NAME).match(name):
        return None
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}… ({len(name):,} characters)"
    return f"{what} must be {MODEL_NAME_RULE if model else NAME_RULE} (got {shown})"


ReplicaId = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX + 24, pattern=MODEL_NAME_PATTERN)]
# A name where an event refers to one (a replica's node, a scaled model): bounded in length only.
# The rule is checked where a name enters the fleet (an inventory, a declaration, a placement, a
# router's map), so a reference outside it matches nothing and is ignored; a pattern per reference
# would cost the hot events (replica states, health changes) half their decoding time.
Ref = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX + 24)]
# A GPU class where a node reports it (an inventory): a model, '-', its memory in GB (H100-80GB),
# as nvml.gpu_class derives it and a fleet file must write it. Where a declaration names a class,
# the names rule is enough: a class no GPU reports matches nothing. A fabric follows the names
# rule, as all detection makes (nvl-<NVLink cluster uuid>-<clique>, ib-<InfiniBand subnet prefix>,
# the node's name) does; a placement on one node has none (""). Bounded here because both are
# shown as they came (status tables, the dashboard) and key the planner's pools.
GPU_CLASS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}-\d{1,6}GB\Z"
GPU_CLASS_MAX = 130  # what the pattern admits
GpuClass = Annotated[str, msgspec.Meta(max_length=GPU_CLASS_MAX, pattern=GPU_CLASS_PATTERN)]
GpuClassRef = Annotated[str, msgspec.Meta(min_length=1, max_length=GPU_CLASS_MAX, pattern=NAME_PATTERN)]
# A fabric as the names rule has it, and ':' '/' '@' '+' besides, which operators' own fabric names
# (--fabric, a fleet file) used before it was bounded ("rack1:ib"); nothing a page could run.
FABRIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z"
FABRIC_RULE = f"1 to {NAME_MAX} of letters, digits, '.', '_', '-', ':', '/', '@', '+', starting with a letter or digit"
_FABRIC = re.compile(FABRIC_PATTERN)
Fabric = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX, pattern=FABRIC_PATTERN)]
FabricRef = Annotated[str, msgspec.Meta(max_length=NAME_MAX, pattern=r"^(?:[A-Za-z0-9][A-Za-z0-9._:/@+-]*)?\Z")]


def fabric_problem(fabric: str) -> str | None:
    """Why ``fabric`` cannot name a fabric (for an error message), or None."""
    if len(fabric) <= NAME_MAX and _FABRIC.match(fabric):
        return None
    shown = repr(fabric) if len(fabric) <= 60 else f"{fabric[:40]!r}… ({len(fabric):,} characters)"
    return f"a fabric must be {FABRIC_RULE} (got {shown})"
Label = Annotated[str, msgspec.Meta(max_length=256)]  # ids, versions, addresses
Text = Annotated[str, msgspec.Meta(max_length=4096)]  # reasons and details for people; paths
Reasons = Annotated[tuple[Text, ...], msgspec.Meta(max_length=64)]
# An aware time: a naive one cannot be compared with the others, and the fold compares them all.
Time = Annotated[datetime, msgspec.Meta(tz=True)]
MAX_GPUS = 4096  # per node; an index, a tp, a pp
MAX_REPLICAS = 10_000
GpuIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GPUS)]
Split = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)]  # tp, pp
Replicas = Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
MAX_PARALLEL = 4096  # sequences one replica serves at once (llama.cpp's -np, vLLM's --max-num-seqs)
# 0: the engine's default (vLLM); llama.cpp always gets -np, 1 when unset.
Parallel = Annotated[int, msgspec.Meta(ge=0, le=MAX_PARALLEL)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # stream sequences, ticks: DuckDB BIGINT
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * 86400)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]  # a model's sizes and counts (config.json)


def utcnow() -> datetime:
    """The publisher's clock; folds never call it, they take ``at`` from events."""
    return datetime.now(UTC)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event: when it happened, and which schema wrote it."""

    at: Time
    v: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = SCHEMA_VERSION


# --- service bodies (request/reply, not stored) -----------------------------


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """What a service answers to a request it cannot serve."""

    error: str
    code: int = 400
