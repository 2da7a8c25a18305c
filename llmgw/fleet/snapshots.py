"""Snapshots of the fold on the bus, so that no fold has to start from sequence 1.

The projector writes one every ``--fold-snapshot-events`` events or
``--fold-snapshot-interval`` (whichever comes first, only when something was
folded) to the JetStream object store ``LLMGW_SNAPSHOTS``: the msgpack of the
state and its cursor (``llmgw.fleet.checkpoint``), and in the object's
description a small JSON header: the format and fold versions, the positions it
reflects, the server's stored time of each position, each stream's creation time,
and the SHA-256 of the blob. Readers list headers only, pick the newest snapshot
that lies wholly before their target, read it, check it, and fold forward.

A snapshot is never trusted blindly: a wrong checksum, another format or fold
version, a position past its stream's end, or a stream created at another time
(deleted and declared again) is skipped with one line on stderr, and the next
older one is tried, down to sequence 1.

Nor does a snapshot say anything the streams do not: whoever can write one (the
projector) could otherwise point a model's traffic anywhere, or hold GPUs for
replicas nobody placed. Every fact that sends traffic or holds GPUs carries the
control-stream sequence it came from (a replica's placement, the report that set
its endpoint, in the fold and in the routers' pool), and a reader that follows the
control stream fetches those messages (one direct get each) and compares them
before it uses the snapshot; one that disagrees is skipped like a bad checksum.
API keys carry no sequence: the key messages up to the snapshot's position are
read again (one filtered read of ``llmgw.control.key.>``, small beside the
stream) and the keys they leave must be the snapshot's, record for record, so a
forged snapshot can neither add a key, bring back a revoked one, nor lift a limit.

Retention (applied by the projector after each write): the newest ``KEEP_NEWEST``,
then the newest of each hour for a week, then the newest of each day for 90 days.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.errors import BusError
from llmgw.fleet.fold import Checkpoint, decode_state
from llmgw.fleet.state import FOLD_VERSION, Cursor, clamp_times

if TYPE_CHECKING:
    from llmgw.bus import Bus

log = logging.getLogger(__name__)

FORMAT = 1
# At most this many events after the snapshot a ``--replay``/``--at`` starts from: ``ctl status`` folds
# ~23k events/s on the 2-core machine, so 25k keeps any moment of a rebuilt history within 2 s (issue 46;
# at 100k a moment just before a snapshot folded ~100k events, 4.5 s). The interval bounds a quiet fleet.
DEFAULT_EVERY_EVENTS = 25_000
DEFAULT_INTERVAL_S = 600.0
KEEP_NEWEST = 48
HOUR_NS, DAY_NS = 3600 * 10**9, 86400 * 10**9
HOURLY_FOR_NS, DAILY_FOR_NS = 7 * DAY_NS, 90 * DAY_NS
MAX_SNAPSHOT_BYTES = 1 << 30  # a state over a GiB is not ours

Warn = Callable[[str], None]


class Header(msgspec.Struct, forbid_unknown_fields=False):
    """What a reader needs to choose a snapshot without reading it (the object's description)."""

    format: int
    fold_version: int
    positions: dict[str, int]
    stored_ns: dict[str, int]
    stream_created: dict[str, str]
    sha256: str
    size: int
    taken_ns: int  # the projector's clock when written (for retention)

    @property
    def newest_ns(self) -> int:
        return max(self.stored_ns.values(), default=0)


_HEADER = msgspec.json.Decoder(Header)


def object_name(header: Header) -> str:
    """Sortable by when the newest message it reflects was stored, then by how much it folded."""
    return f"fold-{header.newest_ns:020d}-{sum(header.positions.values()):012d}"


def header_for(blob: bytes, cursor: Cursor, taken_ns: int) -> Header:
    return Header(format=FORMAT, fold_version=FOLD_VERSION, positions=dict(cursor.positions),
                  stored_ns=dict(cursor.stored_ns), stream_created=dict(cursor.stream_created),
                  sha256=hashlib.sha256(blob).hexdigest(), size=len(blob), taken_ns=taken_ns)


async def write(bus: Bus, blob: bytes, cursor: Cursor, taken_ns: int) -> str:
    """Store ``blob`` (an encoded Checkpoint whose cursor is ``cursor``) and apply retention; its name."""
    header = header_for(blob, cursor, taken_ns)
    bucket = bus.objects(subjects.SNAPSHOT_BUCKET)
    name = object_name(header)
    await bucket.put(name, blob, msgspec.json.encode(header).decode())
    headers = await list_headers(bus)
    for old in expired(headers, taken_ns):
        await bucket.delete(old)
    return name


async def list_headers(bus: Bus, warn: Warn | None = None) -> dict[str, Header]:
    """Every snapshot's header by name; a header that cannot be read is skipped (and said)."""
    out = {}
    for entry in await bus.objects(subjects.SNAPSHOT_BUCKET).list():
        try:
            out[entry.name] = _HEADER.decode(entry.description)
        except msgspec.DecodeError as e:
            if warn is not None:
                warn(f"snapshot {entry.name}: unreadable header ({e}); skipped")
    return out


def expired(headers: dict[str, Header], now_ns: int) -> list[str]:
    """The names retention drops: all but the newest few, hourly for a week and daily for 90 days."""
    by_age = sorted(headers, key=lambda n: (headers[n].taken_ns, n), reverse=True)
    keep = set(by_age[:KEEP_NEWEST])
    seen_hours: set[int] = set()
    seen_days: set[int] = set()
    for name in by_age:
        t = headers[name].taken_ns
        age = now_ns - t
        if age <= HOURLY_FOR_NS:
            if t // HOUR_NS not in seen_hours:
                seen_hours.add(t // HOUR_NS)
                keep.add(name)
        elif age <= DAILY_FOR_NS and t // DAY_NS not in seen_days:
            seen_days.add(t // DAY_NS)
            keep.add(name)
    return sorted(n for n in headers if n not in keep)


class Target(msgspec.Struct):
    """Where a fold must end: every stream at ``stops`` and, per stream in ``cut_ns``, no later than that
    stored time (a moment; the stream an ``--at-seq`` names has a stop, not a cut)."""

    stops: dict[str, int]
    cut_ns: dict[str, int]


def fits(header: Header, target: Target) -> bool:
    """Whether the snapshot lies wholly within what the fold must include."""
    for stream, seq in header.positions.items():
        if stream not in target.stops:
            return False  # it folded a stream this fold leaves out
        if seq > target.stops[stream]:
            return False
        cut = target.cut_ns.get(stream)
        if cut is not None and seq and header.stored_ns.get(stream, cut + 1) > cut:
            return False
    return True


def _why_not(header: Header, blob: bytes | None, heads: dict[str, tuple[int, str]]) -> str:
    if header.format != FORMAT:
        return f"format {header.format}, this reads {FORMAT}"
    if header.fold_version != FOLD_VERSION:
        return f"fold version {header.fold_version}, this folds with {FOLD_VERSION}"
    for stream, seq in header.positions.items():
        if stream not in heads:
            continue  # a stream this reader does not follow (nor may read, under nats.conf): not its to check
        last, created = heads[stream]
        known = header.stream_created.get(stream)
        if known and created and known != created:
            return f"{stream} was created at {created}, the snapshot's at {known} (declared again)"
        if seq > last:
            return f"it reaches {stream}:{seq}, past the stream's end at {last}"
    if blob is not None:
        if len(blob) != header.size or hashlib.sha256(blob).hexdigest() != header.sha256:
            return "its checksum does not match"
    return ""


CHECKS_AT_ONCE = 32  # direct gets in flight while a snapshot's facts are checked
# A claim: the control sequence it names, what it is (for the one line that refuses it), and whether
# the event stored there says it.
Claim = tuple[int, str, Callable[[m.Event], bool]]


def inconsistent(c: Checkpoint) -> str:
    """What a snapshot says that no fold could have made, or ""."""
    for kind, table in (("replica", c.state.replicas), ("routers' replica", c.pool.replicas)):
        for rid, r in table.items():
            if r.replica_id != rid:
                return f"its {kind} {rid!r} is filed under another id ({r.replica_id!r})"
    for p in c.pool.replicas.values():
        if p.in_pool and (p.state != "healthy" or not p.endpoint):
            return f"the routers' pool sends traffic to {p.replica_id}, which is {p.state} at {p.endpoint or 'no endpoint'}"
    return ""


def claims(c: Checkpoint) -> list[Claim]:
    """Every placement and endpoint a snapshot asserts, with the control message it says it came from."""
    out: list[Claim] = []
    for r in c.state.replicas.values():
        out.append((r.placed_seq, f"replica {r.replica_id}'s placement",
                    _placed((r.replica_id, r.model, r.nodes, r.gpus, r.fabric, r.spec), whole=True)))
        if r.endpoint:
            out.append((r.endpoint_seq, f"replica {r.replica_id}'s endpoint {r.endpoint}",
                        _reported(r.replica_id, r.endpoint, r.nodes)))
    for p in c.pool.replicas.values():
        out.append((p.placed_seq, f"the routers' replica {p.replica_id}",
                    _placed((p.replica_id, p.model, p.nodes), whole=False)))
        if p.endpoint:
            out.append((p.endpoint_seq, f"the routers' endpoint {p.endpoint} for {p.replica_id}",
                        _reported(p.replica_id, p.endpoint, p.nodes)))
    return out


def _placed(facts: tuple[object, ...], *, whole: bool) -> Callable[[m.Event], bool]:
    """Whether an event is this placement: id, model, nodes (and, ``whole``, GPUs, fabric and spec)."""
    def says(e: m.Event) -> bool:
        if not isinstance(e, m.ReplicaPlaced):
            return False
        stored = (e.replica_id, e.model, e.nodes, e.gpus, e.fabric, e.spec) if whole else (e.replica_id, e.model, e.nodes)
        return stored == facts
    return says


def _reported(rid: str, endpoint: str, nodes: tuple[str, ...]) -> Callable[[m.Event], bool]:
    """Whether an event is the replica's head (or only node) reporting this endpoint."""
    def says(e: m.Event) -> bool:
        return (isinstance(e, m.ReplicaStateChanged) and e.replica_id == rid and bool(nodes)
                and e.node == nodes[0] and e.endpoint.rstrip("/") == endpoint.rstrip("/"))
    return says


async def unfounded(bus: Bus, c: Checkpoint, control_last: int) -> str:
    """Why a snapshot's placements, endpoints and API keys are not what the control stream holds, or ""."""
    if why := inconsistent(c):
        return why
    checks = claims(c)
    cursor = min(control_last, c.cursor.positions.get(subjects.STREAM_CONTROL, 0))
    for seq, what, _ in checks:
        if not 0 < seq <= cursor:
            return f"{what} names no control message it came from (sequence {seq})"
    gate = asyncio.Semaphore(CHECKS_AT_ONCE)

    async def fetch(seq: int) -> m.Event | str:
        async with gate:
            try:
                subject, data = await bus.stored_message(subjects.STREAM_CONTROL, seq)
                event = m.CONTROL_DECODER.decode(data)
            except BusError as e:
                return f"could not be read ({e})"
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return f"does not decode ({e})"
            # As every fold: an event is believed only on its own subject.
            return event if subjects.disagrees(subject, event) is None else f"was published on {subject!r}"

    async def stopped_after(rid: str) -> int:
        """Where control holds the latest stop of this replica id (0: never stopped)."""
        async with gate:
            return await bus.last_stored_seq(subjects.STREAM_CONTROL, subjects.replica(rid, "stopped"))

    seqs = sorted({seq for seq, _, _ in checks})
    stored = dict(zip(seqs, await asyncio.gather(*(fetch(q) for q in seqs)), strict=True))
    for seq, what, says in checks:
        event = stored[seq]
        if isinstance(event, str):
            return f"{what}: {subjects.STREAM_CONTROL}:{seq} {event}"
        if not says(event):
            return f"{what} is not what {subjects.STREAM_CONTROL}:{seq} says"
    # The keys a router admits by: exactly those the control stream's key messages leave at its position.
    if why := _keys_differ(c.state.keys, await keys_at(bus, cursor)):
        return why
    # A replica stopped after its placement, by the snapshot's own position, is no longer there.
    placed = {r.replica_id: r.placed_seq for r in c.state.replicas.values()}
    placed.update({p.replica_id: p.placed_seq for p in c.pool.replicas.values()})
    stops = await asyncio.gather(*(stopped_after(rid) for rid in placed))
    for (rid, at), stop in zip(placed.items(), stops, strict=True):
        if at < stop <= cursor:
            return f"replica {rid} was stopped at {subjects.STREAM_CONTROL}:{stop}, after its placement at {at}"
    return ""


KEY_SUBJECTS = f"{subjects.PREFIX}.control.key.>"  # every key declared or revoked (the admin role's only)


async def keys_at(bus: Bus, cursor: int) -> dict[str, m.KeyDeclared]:
    """The live API keys as the control stream leaves them at ``cursor``: its key messages (one filtered
    read), folded as every fold folds them (an event is believed only on its own subject, at its clamped time)."""
    keys: dict[str, m.KeyDeclared] = {}
    if cursor <= 0:
        return keys
    reader = bus.reader(subjects.STREAM_CONTROL, 1, stop_at=cursor, filter_subjects=[KEY_SUBJECTS],
                        purpose="checks a fold snapshot's keys")
    async for batch in reader.batches():
        events: list[m.Event] = []
        stored: list[int] = []
        for raw in batch:
            if raw.seq > cursor:
                break
            try:
                event = m.CONTROL_DECODER.decode(raw.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # every fold skips it too
            if subjects.disagrees(raw.subject, event) is None:
                events.append(event)
                stored.append(raw.ts_ns)
        clamp_times(events, stored)
        for folded in events:
            if isinstance(folded, m.KeyDeclared):
                keys[folded.name] = folded
            elif isinstance(folded, m.KeyRevoked):
                keys.pop(folded.name, None)
    return keys


def _keys_differ(said: dict[str, m.KeyDeclared], held: dict[str, m.KeyDeclared]) -> str:
    """How a snapshot's keys differ from the control stream's at its position, or ""."""
    for name in sorted(said):
        if name not in held:
            return f"its key {name!r} is not live in {subjects.STREAM_CONTROL} at its position (never declared, or revoked)"
        if said[name] != held[name]:
            return f"its key {name!r} is not what {subjects.STREAM_CONTROL} last declared for it"
    for name in sorted(held):
        if name not in said:
            return f"it leaves out the key {name!r}, live in {subjects.STREAM_CONTROL} at its position"
    return ""


async def load(bus: Bus, target: Target, heads: dict[str, tuple[int, str]],
               warn: Warn) -> tuple[Checkpoint, str] | None:
    """The newest snapshot that fits ``target`` and checks out, decoded, and its name; None: fold from 1."""
    try:
        headers = await list_headers(bus, warn)
    except BusError as e:
        warn(f"cannot list fold snapshots ({e}); folding from sequence 1")
        return None
    # Snapshots that cannot be right for these streams at all (another version, another
    # incarnation of a stream, past its end) are said once, together, whatever the target.
    bad = {n: why for n, h in headers.items() if (why := _why_not(h, None, heads))}
    if bad:
        first = min(bad)
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        warn(f"snapshot {first} skipped: {bad[first]}{more}")
    chosen = sorted((n for n, h in headers.items() if n not in bad and fits(h, target)), reverse=True)
    for name in chosen:
        header = headers[name]
        if header.size > MAX_SNAPSHOT_BYTES:
            warn(f"snapshot {name} skipped: {header.size:,} bytes is more than a fold holds")
            continue
        try:
            blob = await bus.objects(subjects.SNAPSHOT_BUCKET).get(name)
        except BusError as e:
            warn(f"snapshot {name} skipped: {e}")
            continue
        why = _why_not(header, blob, heads)
        if not why:
            try:
                checkpoint = decode_state(blob)
            except (msgspec.DecodeError, ValueError, TypeError) as e:
                why = f"it does not decode ({e})"
            else:
                if checkpoint.cursor.positions != header.positions:
                    why = "its state and its header disagree"
                elif subjects.STREAM_CONTROL in heads:  # what a reader of control would route or place on
                    try:
                        why = await unfounded(bus, checkpoint, heads[subjects.STREAM_CONTROL][0])
                    except BusError as e:
                        why = f"its placements could not be checked ({e})"
                if not why:
                    return checkpoint, name
        warn(f"snapshot {name} skipped: {why}")
    return None


async def newest(bus: Bus, who: str, streams: tuple[str, ...] = subjects.HISTORY_STREAMS,
                 ) -> tuple[Checkpoint, str] | None:
    """The newest snapshot of ``streams`` as stored now: where a service's start-up fold begins.

    Only the streams the service follows are checked (a router may not even ask about the
    fleet stream); what the snapshot folded of the others is not the service's to use.
    """
    heads = {s: await bus.stream_head(s) for s in streams}
    unread = {s: 2**63 for s in subjects.HISTORY_STREAMS if s not in heads}
    target = Target(stops={**{s: h[0] for s, h in heads.items()}, **unread}, cut_ns={})
    found = await load(bus, target, heads, lambda line: log.warning("%s: %s", who, line))
    if found is not None:
        log.info("%s: the fold starts from snapshot %s", who, found[1])
    return found
