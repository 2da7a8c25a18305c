"""The DuckDB store: schema, row batches, and the checkpoint; the only module importing duckdb.

One ``commit`` writes a batch's history rows (derived in SQL from the raw payloads; undecodable
ones through the appender), rebuilds the current views from the folded state, and records the
stream positions and an encoded FleetState, all in one transaction. A resumed projector loads
that state and those positions and goes on exactly where the commit left it.

Over 600 lines: it is the only module that imports duckdb, and the schema's SQL, the
migrations and the one commit that writes rows and positions together are one
transaction's worth of code; split, a change to a table would touch two files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import compress
from operator import ne
from pathlib import Path
from typing import Any

import duckdb
import msgspec

from llmgw import messages as m
from llmgw.errors import ProjectionError
from llmgw.fleet.fold import Checkpoint, decode_state
from llmgw.fleet.state import (
    MAX_AHEAD,
    MAX_BEHIND,
    OBSERVED_MIB_MAX,
    FleetState,
    RouterView,
    requests_moved,
)
from llmgw.projections import schema
from llmgw.subjects import STREAM_CONTROL, STREAM_FLEET

log = logging.getLogger(__name__)

# 2: the usage fold forgets replicas that left every router's map, so a state checkpointed
# by schema 1 would not resume into what a clean replay gives. 3: the reader's bookkeeping
# moved into the cursor. 4: the analysts' names (projections/schema.py: node, model,
# gpu_count, lists for nodes and reasons, NULL for an unknown idle time) and the views.
# 5: one meaning per word: the table ``checkpoint`` is ``positions`` and the column
# ``projector_state.snapshot`` is ``checkpoint`` (a schema-4 file is renamed in place).
# 6: GPUs shared by memory: the history of who booked how much of each GPU (gpu_bookings) and what
# the engines held (replica_memory), and ``gpus`` lists the replicas booked on a card (a schema-5
# file gets both tables filled from its events, in place).
# 7: usage_by_key counts, of the errors, the 429s (throttled) and the 403s (forbidden) apart (NULL in the
# rows a schema-6 file held: their maps were not kept, so only their errors are known).
SCHEMA_VERSION = 7
# The XID number in a GPU's reasons (the agent's "xid 79: …", a fleet file's "xid-79"); NULL: none.
XID = "TRY_CAST(nullif(regexp_extract({reasons}, 'xid[ -]?([0-9]+)', 1), '') AS INTEGER)"
# A stop's code from its wording, for events written before codes (ReplicaStopped.stop_code's table).
STOP_CODE = "CASE " + " ".join(f"WHEN {{reason}} LIKE '{prefix}%' THEN '{code}'"
                               for prefix, code in m.STOP_PREFIXES) + " END"
# Who booked how much of each GPU, and what the engines held, from the rows of ``{source}`` (a relation
# with the staged columns: stream, seq, ts and x, the extracted fields): the commit's stage, or, to
# fill a file of schema 5 in place, every event it holds. A placement's GPUs come from its payload
# (``mib`` 0, from before sharing: the whole card, as the ``gpus`` table has it); a stop frees the
# GPUs of the replica's latest placement before it, once (a second stop of one placement adds nothing; it
# reads only the bookings of the replicas the batch stops: the whole table grows with the history);
# a replica's report of what its engine holds is kept where the fold would keep it.
_BOOKINGS = """
INSERT INTO gpu_bookings
SELECT s.stream, s.seq, s.ts, s.node, s.gpu_index, s.gpu_uuid, s.replica_id, s.model, 'placed',
       coalesce(nullif(s.mib, 0), c.memory_mib), c.memory_mib
FROM (SELECT stream, seq, ts, x[8] AS replica_id, x[5] AS model, g.node AS node, g.index AS gpu_index,
             g.uuid AS gpu_uuid, g.mib AS mib
      FROM (SELECT stream, seq, ts, x,
                   unnest(from_json(x[16], '[{"node": "VARCHAR", "index": "INTEGER", "uuid": "VARCHAR", "mib": "BIGINT"}]'))
                       AS g
            FROM {source} WHERE x[1] = 'ReplicaPlaced')) s
LEFT JOIN gpus c ON c.gpu_uuid = s.gpu_uuid;
INSERT INTO gpu_bookings
WITH stops AS (SELECT stream, seq, ts, x[8] AS replica_id FROM {source} WHERE x[1] = 'ReplicaStopped'),
     mine AS MATERIALIZED (SELECT * FROM gpu_bookings WHERE replica_id IN (SELECT replica_id FROM stops))
SELECT f.stream, f.seq, f.ts, b.node, b.gpu_index, b.gpu_uuid, b.replica_id, b.model, 'stopped', b.booked_mib,
       b.memory_mib
FROM (SELECT arg_min(stream, seq) AS stream, min(seq) AS seq, arg_min(ts, seq) AS ts, replica_id, placed_seq
      FROM (SELECT s.stream, s.seq, s.ts, s.replica_id,
                   (SELECT max(p.seq) FROM mine p
                    WHERE p.event = 'placed' AND p.replica_id = s.replica_id AND p.seq < s.seq) AS placed_seq
            FROM stops s)
      WHERE placed_seq IS NOT NULL GROUP BY replica_id, placed_seq) f
JOIN mine b ON b.event = 'placed' AND b.replica_id = f.replica_id AND b.seq = f.placed_seq
WHERE NOT EXISTS (SELECT 1 FROM mine q
                  WHERE q.event = 'stopped' AND q.replica_id = f.replica_id AND q.seq > f.placed_seq);
INSERT INTO replica_memory
SELECT stream, seq, ts, x[8], x[5], x[3], x[19]::BIGINT, 'state'
FROM {source} WHERE x[1] = 'ReplicaStateChanged' AND x[19]::BIGINT BETWEEN 1 AND @MAX@
UNION ALL
SELECT stream, seq, ts, x[8], x[5], x[3], x[20]::BIGINT, 'overbooked'
FROM {source} WHERE x[1] = 'ReplicaOverBooked' AND x[20]::BIGINT BETWEEN 1 AND @MAX@;
""".replace("@MAX@", str(OBSERVED_MIB_MAX))

# Older schemas a projector brings up to this one in place, one step at a time: schema 5 renamed two
# names and added gpu_health.xid and replica_lifecycle.code, filled in for the rows already there;
# schema 6 added the bookings' history, filled from the events the file holds; schema 7 the 429s and 403s
# of usage_by_key, unknown (NULL) for the rows already there.
MIGRATIONS = {
    4: ["ALTER TABLE checkpoint RENAME TO positions",
        "ALTER TABLE projector_state RENAME COLUMN snapshot TO checkpoint",
        "ALTER TABLE gpu_health ADD COLUMN xid INTEGER",
        f"UPDATE gpu_health SET xid = {XID.format(reasons='array_to_string(reasons, chr(10))')}",
        "ALTER TABLE replica_lifecycle ADD COLUMN code VARCHAR",
        f"UPDATE replica_lifecycle SET code = {STOP_CODE.format(reason='detail')} WHERE kind = 'stopped'",
        "UPDATE projector_state SET schema_version = 5 WHERE id = 1"],
    5: [schema.create_table("gpu_bookings"), schema.create_table("replica_memory"),
        # The events it holds, as the stage has them: the fields the bookings read, by the stage's indexes.
        "CREATE TEMP TABLE migrated AS SELECT stream, seq, ts, [type, NULL, node, NULL, model, NULL, NULL, replica_id, "
        "NULL, NULL, NULL, NULL, NULL, NULL, NULL, json->>'$.gpus', NULL, NULL, json->>'$.observed_memory_mib', "
        "json->>'$.used_mib'] AS x FROM events WHERE type IN ('ReplicaPlaced', 'ReplicaStopped', "
        "'ReplicaStateChanged', 'ReplicaOverBooked') ORDER BY stream, seq",
        # The placements first, so that every stop finds its placement.
        *_BOOKINGS.replace("{source}", "migrated").split(";\n")[:-1],
        "DROP TABLE migrated",
        "ALTER TABLE gpus ADD COLUMN replica_ids VARCHAR[]",
        "ALTER TABLE gpus ADD COLUMN booked_mib BIGINT",
        "UPDATE gpus SET replica_ids = CASE WHEN replica_id IS NULL THEN [] ELSE string_split(replica_id, ', ') END, "
        "booked_mib = coalesce((SELECT sum(CASE b.event WHEN 'placed' THEN b.booked_mib ELSE -b.booked_mib END) "
        "FROM gpu_bookings b WHERE b.gpu_uuid = gpus.gpu_uuid), 0)",
        "ALTER TABLE gpus DROP COLUMN replica_id",
        "UPDATE projector_state SET schema_version = 6 WHERE id = 1"],
    6: ["ALTER TABLE usage_by_key ADD COLUMN throttled BIGINT",
        "ALTER TABLE usage_by_key ADD COLUMN forbidden BIGINT",
        "UPDATE projector_state SET schema_version = 7 WHERE id = 1"],
}

HISTORY_TABLES = ("events", "gpu_health", "replica_lifecycle", "idle_history", "prefix_cache", "usage_by_key",
                  "gpu_bookings", "replica_memory", "unprojected_events")
VIEW_TABLES = ("nodes", "gpus", "replicas", "models", "unplaceable")
TABLES = ("positions", "projector_state", *HISTORY_TABLES, *VIEW_TABLES)

# Python hands DuckDB as little as it can: per stream and commit, the raw
# messages of the decoded events as four strings (sequences, subjects, stored
# times, payloads), which DuckDB splits into rows and parses once, in the same
# statement, into stage_parsed; one INSERT … SELECT per table then derives the
# typed columns, the GPU health incidents, the replica lifecycle and the idle
# history inside the commit's transaction, in DuckDB's own threads. An idle
# map's payload is replaced by what changed since its router's previous map
# (``idle_payload``), which only the fold knows.
STAGING = """
CREATE TEMP TABLE IF NOT EXISTS stage_parsed (
    stream VARCHAR, seq BIGINT, subject VARCHAR, stored_ns BIGINT, json VARCHAR, ts TIMESTAMPTZ, x VARCHAR[]);
"""

# One chunk: the stream, then comma-separated sequences, newline-separated subjects
# (a subject has no whitespace), comma-separated stored times (ns), and payloads
# separated by the ASCII record separator, chr(30): JSON allows no raw control
# character, so no payload msgspec decoded holds one, and each is stored as published.
def _json_path(*names: str) -> str:
    """``$.a.b`` for a field path of the events in messages.py; a name no event has is an import error.

    The store reads payloads by these paths, so they are derived from the one schema
    rather than written out: renaming a field there breaks here at once, not in a query.
    """
    types: list[Any] = list(typing.get_args(m.AnyEvent))
    for name in names:
        fields = {f.name: f.type for t in types for f in msgspec.structs.fields(t)}
        if name not in fields:
            raise AssertionError(f"no event in llmgw.messages has a field {name!r} (path {'.'.join(names)})")
        t = fields[name]
        types = [t] if isinstance(t, type) and issubclass(t, msgspec.Struct) else []
    return "$." + ".".join(names)


# x[1..20], in this order (see _FROM_STAGE): the tag, then fields by their messages.py names.
_PATHS = ["$.type", *(_json_path(*p.split(".")) for p in (
    "at", "node")), "$.nodes[0]", *(_json_path(*p.split(".")) for p in (
    "model", "name", "spec.name", "replica_id", "gpu_index", "gpu_uuid", "healthy", "state", "detail", "reason",
    "nodes", "gpus", "reasons", "code", "observed_memory_mib", "used_mib"))]
# ``ts`` is the event's time as the fold takes it: the time the stream stored it when its own
# is outside the window fold.clamp_times allows (the same bounds, in microseconds).
_STAGE_CHUNK = f"""
INSERT INTO stage_parsed
SELECT $1, seq, subject, stored_ns, json,
       CASE WHEN t BETWEEN s - to_microseconds({MAX_BEHIND // timedelta(microseconds=1)})
                       AND s + to_microseconds({MAX_AHEAD // timedelta(microseconds=1)}) THEN t ELSE s END, x
FROM (SELECT seq::BIGINT AS seq, subject, stored_ns::BIGINT AS stored_ns, json, x,
             try_cast(x[2] AS TIMESTAMPTZ) AS t, make_timestamptz(stored_ns::BIGINT // 1000) AS s
      FROM (SELECT *, json_extract_string(json, [{", ".join(f"'{p}'" for p in _PATHS)}]) AS x
            FROM (SELECT unnest(string_split($2, ',')) AS seq, unnest(string_split($3, chr(10))) AS subject,
                         unnest(string_split($4, ',')) AS stored_ns, unnest(string_split($5, chr(30))) AS json)))
"""  # (casting outside the unnest is a third faster than inside)

# A key's salt and digest are the routers' (read from the control stream), never an analyst's: a
# KeyDeclared is stored without them, and a file written before that loses them when it is opened.
KEY_SECRETS = ("salt", "digest")
KEY_PUBLIC = "json_merge_patch(json, '{" + ", ".join(f'"{k}": null' for k in KEY_SECRETS) + "}')::VARCHAR"
FORGET_KEY_SECRETS = (f"UPDATE events SET json = {KEY_PUBLIC} WHERE type = 'KeyDeclared' AND ("
                      + " OR ".join(f"json_exists(json, '$.{k}')" for k in KEY_SECRETS) + ")")

# x: type, at, node, nodes[0], model, name, spec.name, replica_id, gpu_index, gpu_uuid,
#    healthy, state, detail, reason, nodes, gpus, reasons (these three as JSON text, so that
#    no query parses a whole payload a second time), code, observed_memory_mib, used_mib
_FROM_STAGE = """
INSERT INTO events
SELECT stream, seq, subject, CASE x[1] WHEN 'IdleChanges' THEN 'IdleMapPublished' ELSE x[1] END, ts,
       make_timestamptz(stored_ns // 1000), coalesce(x[3], x[4]),
       coalesce(x[5], x[6], x[7]), x[8], CASE x[1] WHEN 'IdleChanges' THEN NULL
                                              WHEN 'KeyDeclared' THEN @KEY_PUBLIC@ ELSE json END
FROM stage_parsed;
INSERT INTO gpu_health
SELECT stream, seq, ts, x[3], x[9]::INTEGER, x[10], x[11]::BOOLEAN, coalesce(x[17]::JSON::VARCHAR[], []),
       @XID@
FROM stage_parsed WHERE x[1] = 'GpuHealthChanged';
INSERT INTO replica_lifecycle
SELECT stream, seq, ts, x[8], x[5],
       CASE x[1] WHEN 'ReplicaPlaced' THEN 'placed' WHEN 'ReplicaStopped' THEN 'stopped' ELSE 'state' END,
       CASE x[1] WHEN 'ReplicaPlaced' THEN 'placed' WHEN 'ReplicaStopped' THEN 'stopped' ELSE x[12] END,
       CASE x[1] WHEN 'ReplicaPlaced' THEN x[15]::JSON::VARCHAR[] WHEN 'ReplicaStateChanged' THEN [x[3]] END,
       CASE x[1] WHEN 'ReplicaPlaced' THEN json_array_length(x[16])::INTEGER END,
       CASE x[1] WHEN 'ReplicaStateChanged' THEN x[13] ELSE x[14] END,
       CASE x[1] WHEN 'ReplicaStopped' THEN coalesce(nullif(x[18], ''), @STOP_CODE@) END
FROM stage_parsed WHERE x[1] IN ('ReplicaPlaced', 'ReplicaStateChanged', 'ReplicaStopped');
INSERT INTO idle_history
SELECT stream, seq, ts, router, tick, replica_id, last_request, serving_since,
       -- ts - the newer of the two times (the same float as Python's timedelta.total_seconds()); NULL: unknown
       CASE WHEN newest IS NOT NULL THEN greatest(0.0, (epoch_us(ts) - epoch_us(newest)) / 1e6) END
FROM (SELECT *, greatest(coalesce(last_request, serving_since), coalesce(serving_since, last_request)) AS newest
      FROM (SELECT stream, seq, ts, m.router, m.tick, c[1] AS replica_id, c[2]::TIMESTAMPTZ AS last_request,
                   c[3]::TIMESTAMPTZ AS serving_since
            FROM (SELECT stream, seq, ts, m, unnest(m.changes) AS c
                  FROM (SELECT stream, seq, ts,
                               json_transform(json, '{"router": "VARCHAR", "tick": "BIGINT", "changes": [["VARCHAR"]]}')
                               AS m
                        FROM stage_parsed WHERE x[1] = 'IdleChanges'))));
INSERT INTO prefix_cache
SELECT stream, seq, ts, m.router, c[1], c[2], c[3]::BIGINT, c[4]::BIGINT
FROM (SELECT stream, seq, ts, m, unnest(m.cache) AS c
      FROM (SELECT stream, seq, ts, json_transform(json, '{"router": "VARCHAR", "cache": [["VARCHAR"]]}') AS m
            FROM stage_parsed WHERE x[1] = 'IdleChanges' AND json LIKE '%"cache":[[%'));
INSERT INTO usage_by_key
SELECT stream, seq, ts, m.router, c[1], c[2], c[3]::BIGINT, c[4]::BIGINT, c[5]::BIGINT, c[6]::BIGINT, c[7]::BIGINT,
       c[8]::DOUBLE, c[9]::DOUBLE, coalesce(c[10]::BIGINT, 0), coalesce(c[11]::BIGINT, 0)
FROM (SELECT stream, seq, ts, m, unnest(m.keys) AS c
      FROM (SELECT stream, seq, ts, json_transform(json, '{"router": "VARCHAR", "keys": [["VARCHAR"]]}') AS m
            FROM stage_parsed WHERE x[1] = 'IdleChanges' AND json LIKE '%"keys":[[%'));
""".replace("@KEY_PUBLIC@", KEY_PUBLIC).replace("@XID@", XID.format(reasons="x[17]")).replace(
    "@STOP_CODE@", STOP_CODE.format(reason="x[14]"))
_CLEAR_STAGE = "DELETE FROM stage_parsed;"


# A whole-card booking (mib 0) whose card no inventory had named when it was written takes the card's
# memory once one does: the rows then do not depend on how the events were cut into commits (a crash
# and a resume, or one long batch), only on the events.
_CARDS_KNOWN = """
UPDATE gpu_bookings SET booked_mib = coalesce(gpu_bookings.booked_mib, c.memory_mib), memory_mib = c.memory_mib
FROM gpus c WHERE gpu_bookings.memory_mib IS NULL AND c.gpu_uuid = gpu_bookings.gpu_uuid;
"""


def _from_stage(chunks: list[Chunk]) -> str:
    """The history rows of the staged chunks; the bookings' only when the control stream is among them (its
    events are few, the usage stream's idle maps most of a busy fleet's commits), and the cards an
    inventory names filled in where a booking waited for them."""
    control = any(c[0] == STREAM_CONTROL for c in chunks)
    fleet = any(c[0] == STREAM_FLEET for c in chunks)
    return (_FROM_STAGE + (_BOOKINGS.replace("{source}", "stage_parsed") if control else "")
            + (_CARDS_KNOWN if control or fleet else "") + _CLEAR_STAGE)

Chunk = tuple[str, str, str, str, str]  # stream, seqs, subjects, stored ns, payloads (see _STAGE_CHUNK)
Raw = tuple[list[int], list[str], list[int], list[bytes]]  # a stream's messages as those four columns


@dataclass
class Batch:
    """Everything one commit writes: history, the state it leads to, positions.

    ``raw`` collects, per stream, the messages of decoded events as columns (sequence, subject, stored
    ns, payload); ``pack`` joins each into a chunk of four strings, all a commit hands DuckDB for them."""

    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=lambda: {"unprojected_events": []})
    raw: dict[str, Raw] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    events: int = 0

    def __len__(self) -> int:
        return self.events

    def add_raw(self, stream: str, seqs: list[int], subjects: list[str], stored_ns: list[int],
                payloads: list[bytes]) -> None:
        """Messages of decoded events, in stream order."""
        cols = self.raw.get(stream)
        if cols is None:
            cols = self.raw[stream] = ([], [], [], [])
        cols[0].extend(seqs)
        cols[1].extend(subjects)
        cols[2].extend(stored_ns)
        cols[3].extend(payloads)
        self.events += len(seqs)

    def pack(self) -> Batch:
        """Join the collected columns into chunks (once; cheap to call again)."""
        for stream, (seqs, subjects, stored, payloads) in self.raw.items():
            if not seqs:
                continue
            blob = b"\x1e".join(payloads)
            self.chunks.append((stream, ",".join(map(str, seqs)), "\n".join(subjects),
                                ",".join(map(str, stored)), blob.decode("utf-8", "replace")))
        self.raw = {}
        return self


# A chunk's columns after the stream, and what separates their items (see _STAGE_CHUNK).
_SEPS = (",", "\n", ",", "\x1e")
# What DuckDB raises for a value it cannot take (a cast out of range, malformed input),
# as opposed to the disk or the transaction failing.
_DATA_ERRORS = (duckdb.DataError, duckdb.InvalidInputException)


def _join_col(msgs: list[tuple[str, str, str, str]], i: int, sep: str) -> str:
    return sep.join(x[i] for x in msgs)


def _without(chunks: list[Chunk], drop: set[tuple[str, int]]) -> list[Chunk]:
    """``chunks`` less the messages (stream, seq) in ``drop``."""
    out: list[Chunk] = []
    for stream, *cols in chunks:
        msgs = [x for x in zip(*(c.split(sep) for c, sep in zip(cols, _SEPS, strict=True)), strict=True)
                if (stream, int(x[0])) not in drop]
        if msgs:
            out.append((stream, *(_join_col(msgs, i, sep) for i, sep in enumerate(_SEPS))))  # type: ignore[arg-type]
    return out


class _IdleChanges(msgspec.Struct, tag="IdleChanges", tag_field="type"):
    """What an idle map leaves for DuckDB: its time, router and tick, and the entries that changed.

    Staged only, never stored: its own tag keeps it from passing for an ``IdleMapPublished``
    (the events table records the map under that type, with no payload).
    """

    at: datetime
    router: str
    tick: int
    changes: list[tuple[str, datetime | None, datetime | None]]  # replica, last request, serving since
    cache: list[tuple[str, str, int, int]] = []  # replica, model, prompt tokens, cached tokens (cache_use)
    # key, model, requests, errors, prompt, completion, cached tokens, ttft and latency sums, and of the
    # errors the 429s and the 403s (callers)
    keys: list[tuple[str, str, int, int, int, int, int, float, float, int, int]] = []


_IDLE_ENCODER = msgspec.json.Encoder()


def idle_payload(event: m.IdleMapPublished, prev: RouterView | None, moved: list[str] | None = None) -> bytes:
    """An idle map as DuckDB gets it: a change per replica whose entry appeared, moved, or vanished.

    ``prev`` is the router's map this one follows. Repeating an unchanged entry every tick would write
    routers × replicas rows per tick; the changes carry the same history and an idle stretch is the gap
    between two of them. A busy fleet changes tens of entries a tick, so Python only finds which (the
    fold has the previous map at hand) and encodes them in one call; DuckDB turns them into idle_history
    rows and computes ``idle_s``. ``moved`` is the map's ``requests_moved``, which the fold computed already.
    """
    last, serving = event.last_request, event.serving_since
    if prev is not None and prev.boot_id == event.boot_id:
        plast, pserving = prev.last_request, prev.serving_since
        if last == plast and serving == pserving:
            changed: set[str] = set()  # the common quiet tick: nothing moved
        else:
            # Appeared or moved, then vanished; iterated in C, since most entries are unchanged.
            changed = set(moved if moved is not None else requests_moved(event, prev))
            changed.update(compress(serving, map(ne, serving.values(), map(pserving.get, serving))))
            changed.update(plast.keys() - last.keys(), pserving.keys() - serving.keys())
    else:  # a first map, or a restarted router: everything it says (or forgot) is news
        changed = last.keys() | serving.keys()
        if prev is not None:
            changed |= prev.last_request.keys() | prev.serving_since.keys()
    cache = [(r, u.model, u.prompt_tokens, u.cached_tokens) for r, u in event.cache_use.items()]
    keys = [(k, model, u.requests, u.errors, u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.ttft_s,
             u.latency_s, u.throttled, u.forbidden) for k, per in event.callers.items() for model, u in per.items()]
    return _IDLE_ENCODER.encode(_IdleChanges(
        event.at, event.router, event.tick, [(r, last.get(r), serving.get(r)) for r in sorted(changed)], cache, keys))


def add_event_rows(batch: Batch, stream: str, seq: int, subject: str, data: bytes, ts_ns: int, event: m.Event,
                   prev_router: RouterView | None = None) -> None:
    """The rows one decoded event adds; ``prev_router`` is the map an IdleMapPublished follows."""
    if type(event) is m.IdleMapPublished:
        data = idle_payload(event, prev_router)
    batch.add_raw(stream, [seq], [subject], [ts_ns], [data])


def add_unprojected(batch: Batch, stream: str, seq: int, subject: str, data: bytes, error: str) -> None:
    batch.rows["unprojected_events"].append((stream, seq, subject, data, error))
    batch.events += 1


def view_rows(state: FleetState) -> dict[str, list[tuple[Any, ...]]]:
    """The current views, rebuilt whole from the folded state."""
    holders = state.gpu_replicas()
    placed: dict[str, int] = {}
    for r in state.replicas.values():
        placed[r.model] = placed.get(r.model, 0) + 1
    return {
        "nodes": [
            (n.name, n.fabric, n.fabric_source, n.boot_id, len(n.gpus), sum(g.healthy for g in n.gpus.values()),
             n.lost, n.lost_at, n.simulated, n.updated_at)
            for n in state.nodes.values()
        ],
        "gpus": [
            (g.node, g.index, g.uuid, g.name, g.gpu_class, g.memory_mib, g.healthy, g.reasons, g.since,
             [rid for rid, _ in on], sum(mib for _, mib in on))
            for g in state.gpus() for on in [holders.get((g.node, g.index), [])]
        ],
        "replicas": [
            (r.replica_id, r.model, r.state, r.nodes, len(r.gpus), r.fabric, r.placed_at, r.state_at,
             r.endpoint, r.restarts, state.idle_since(r.replica_id))
            for r in state.replicas.values()
        ],
        "models": [
            (v.spec.name, v.spec.engine, v.spec.precision, v.spec.gpu_class, v.spec.tp, v.spec.pp,
             v.replicas_wanted, placed.get(v.spec.name, 0), v.declared_at)
            for v in state.models.values()
        ],
        "unplaceable": [
            (v.spec.name, v.unplaceable_reason, v.unplaceable_at)
            for v in state.models.values()
            if v.unplaceable_reason is not None
        ],
    }


# A copy of the live file taken with ``cp`` holds what DuckDB last flushed from its WAL into the
# file (its CHECKPOINT statement); past DuckDB's threshold it flushes by size only, which a quiet
# fleet takes hours to reach. Flushing at least this often keeps such a copy at most this old.
WAL_FLUSH_INTERVAL_S = 60.0

# The analysts' copy is written in this storage version, so that the DuckDB CLI people
# install (duckdb-cli 1.5.x from PyPI) opens it; the live file is in the library's own.
COPY_STORAGE_VERSION = "v1.5.0"


def _other_schema(path: str, version: int) -> ProjectionError:
    return ProjectionError(f"{path} was written by projector schema {version}, this is {SCHEMA_VERSION}; "
                           "project into a new file (history replays from the streams)")


class Store:
    """One DuckDB database (a file, or ``:memory:``) owned by one projector."""

    def __init__(self, path: str | Path, *, lock_wait_s: float = 3.0,
                 flush_interval_s: float = WAL_FLUSH_INTERVAL_S, threads: int | None = None) -> None:
        self.path = str(path)
        self.flush_interval_s = flush_interval_s
        self._flushed = time.monotonic()
        try:
            self.con = self._connect(lock_wait_s)
        except duckdb.IOException as e:
            raise ProjectionError(
                f"cannot open {self.path}: {e}; another projector may hold it (DuckDB allows one writer per "
                "file); query its analysts' copy (<db>.analysts.duckdb) or build a private copy with "
                "`llmgw project --once --db mine.duckdb`"
            ) from e
        self.con.execute("SET TimeZone = 'UTC'")
        if threads is not None:  # DuckDB's default: one per core
            self.con.execute(f"SET threads = {int(threads)}")
        # A commit of a busy second is ~25 MB of WAL. At DuckDB's default threshold (16 MB) every commit
        # checkpoints, recompressing the half-filled row groups it appended to: a third of the projector's
        # DuckDB time. Every ~3 commits costs no more CPU than every ~10 (256 MB), and a catch-up's
        # checkpoints then run during the read, where at 256 MB the whole history waited for the close
        # (0.8 s after a 300k read, issue 46). A crash replays at most this much WAL.
        self.con.execute("SET checkpoint_threshold = '64MB'")
        self._create_schema()
        self.con.execute(STAGING)

    def _create_schema(self) -> None:
        """The tables, views and comments; a file of another schema version is refused first.

        Its tables would not have the columns the views read, and the operator must hear what to do,
        not DuckDB's binder error."""
        con = self.con
        found = con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
                            "AND schema_name = 'main' AND table_name = 'projector_state'").fetchone()
        if found and found[0]:
            row = con.execute("SELECT schema_version FROM projector_state WHERE id = 1").fetchone()
            if row is not None and row[0] in MIGRATIONS:
                self._migrate(row[0])
            elif row is not None and row[0] != SCHEMA_VERSION:
                self.close()
                raise _other_schema(self.path, row[0])
        try:
            con.execute("BEGIN TRANSACTION")
            con.execute(";\n".join(schema.statements()))
            con.execute(FORGET_KEY_SECRETS)
            con.execute("COMMIT")
        except duckdb.Error as e:
            self.close()
            raise ProjectionError(f"cannot create llmgw's tables in {self.path}: {e}; it was written by another "
                                  "version, or is not llmgw's: project into a new file (history replays from "
                                  "the streams)") from e

    def _migrate(self, version: int) -> None:
        """Bring a file of an older schema up to this one, step by step, in one transaction."""
        con = self.con
        try:
            con.execute("BEGIN TRANSACTION")
            for step in range(version, SCHEMA_VERSION):
                for sql in MIGRATIONS[step]:
                    con.execute(sql)
            con.execute("COMMIT")
        except duckdb.Error as e:
            with contextlib.suppress(duckdb.Error):
                con.execute("ROLLBACK")
            self.close()
            raise ProjectionError(f"cannot bring {self.path} from projector schema {version} to {SCHEMA_VERSION}: "
                                  f"{e}; project into a new file (history replays from the streams)") from e
        log.info("%s: projector schema %d brought to %d in place", self.path, version, SCHEMA_VERSION)

    def _connect(self, lock_wait_s: float) -> duckdb.DuckDBPyConnection:
        """Open the file, waiting a little for a lock held by a projector that is still dying.

        A restart right after a crash can find the old writer process not yet
        reaped; a projector that is alive still gets the error after the wait.
        """
        deadline = time.monotonic() + lock_wait_s
        while True:
            try:
                con = duckdb.connect(self.path)
                # No progress bar: DuckDB draws one on the terminal for a statement that runs over
                # 2 s (a large commit, the analysts' copy), in the projector's logs.
                con.execute("SET enable_progress_bar = false")
                return con
            except duckdb.IOException as e:
                if "lock" not in str(e).lower() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        self.con.close()  # closing twice is harmless

    def load(self) -> Checkpoint:
        """The state and cursor of the last commit, or empty ones."""
        row = self.con.execute("SELECT schema_version, checkpoint FROM projector_state WHERE id = 1").fetchone()
        if row is None:
            return Checkpoint()
        version, blob = row
        if version != SCHEMA_VERSION:
            raise _other_schema(self.path, version)
        checkpoint = decode_state(blob)
        positions = dict(self.con.execute("SELECT stream, seq FROM positions").fetchall())
        if positions != checkpoint.cursor.positions:
            raise ProjectionError(f"{self.path}: positions {positions} disagree with its state "
                                  f"{checkpoint.cursor.positions}")
        return checkpoint

    def commit(self, batch: Batch, checkpoint: bytes, before_commit: Callable[[], None] | None = None) -> None:
        """Write a batch, the views of ``checkpoint`` (encoded) and its positions in one transaction.

        A message whose history rows DuckDB refuses (a value its columns cannot
        hold) must not stop the projection at every restart: the batch is tried
        again without it, and it is kept in ``unprojected_events`` with the reason.
        The fold applied it like any other; only its history rows are missing.
        """
        batch.pack()
        try:
            self._commit(batch, checkpoint, before_commit)
        except ProjectionError as e:
            if not isinstance(e.__cause__, _DATA_ERRORS) or not batch.chunks:
                raise
            refused = self._unwritable(batch.chunks)
            if not refused:
                raise  # not a message's rows (the views, the disk): nothing to set aside
            batch.chunks = _without(batch.chunks, {(r[0], r[1]) for r in refused})
            batch.rows["unprojected_events"].extend(refused)
            self._commit(batch, checkpoint, before_commit)
        if time.monotonic() - self._flushed >= self.flush_interval_s:
            try:
                self.flush_wal()
            except ProjectionError as e:  # the commit is safe in the WAL; only a copy of the file is staler
                log.warning("%s", e)
                self._flushed = time.monotonic()

    def flush_wal(self) -> None:
        """Write what the WAL holds into the file itself, so that a plain copy of it has every commit."""
        try:
            self.con.execute("CHECKPOINT")
        except duckdb.Error as e:
            raise ProjectionError(f"cannot flush the WAL of {self.path} into it: {e}") from e
        self._flushed = time.monotonic()

    def _unwritable(self, chunks: list[Chunk]) -> list[tuple[Any, ...]]:
        """The messages of ``chunks`` whose rows DuckDB refuses, as unprojected rows; found by halving."""
        out: list[tuple[Any, ...]] = []

        def error_of(msgs: list[tuple[str, str, str, str]], stream: str) -> str | None:
            con = self.con
            con.execute("BEGIN TRANSACTION")
            try:
                con.execute(_STAGE_CHUNK, [stream, *(_join_col(msgs, i, sep) for i, sep in enumerate(_SEPS))])
                con.execute(_from_stage([(stream, "", "", "", "")]))
            except _DATA_ERRORS as e:
                return str(e)
            finally:
                con.execute("ROLLBACK")
            return None

        def search(msgs: list[tuple[str, str, str, str]], stream: str, error: str) -> None:
            if len(msgs) == 1:
                seq, subject, _, payload = msgs[0]
                out.append((stream, int(seq), subject, payload.encode(), f"the store cannot write it: {error}"))
                return
            for half in (msgs[: len(msgs) // 2], msgs[len(msgs) // 2:]):
                if (e := error_of(half, stream)) is not None:
                    search(half, stream, e)

        for stream, *cols in chunks:
            msgs = list(zip(*(col.split(sep) for col, sep in zip(cols, _SEPS, strict=True)), strict=True))
            if (e := error_of(msgs, stream)) is not None:
                search(msgs, stream, e)
        return out

    def _commit(self, batch: Batch, checkpoint: bytes, before_commit: Callable[[], None] | None) -> None:
        # The reader folds on while this commits, so the state arrives as bytes: a copy nobody mutates.
        state, cursor = (c := decode_state(checkpoint)).state, c.cursor
        con = self.con
        con.execute("BEGIN TRANSACTION")
        try:
            for chunk in batch.pack().chunks:
                con.execute(_STAGE_CHUNK, list(chunk))
            for table, rows in batch.rows.items():
                if rows:
                    app = con.appender(table)
                    app.append_rows(rows)
                    app.flush()
            # The current tables first: a placement's whole card is booked at the memory ``gpus`` now says.
            for table, rows in view_rows(state).items():
                con.execute(f"DELETE FROM {table}")
                if rows:
                    app = con.appender(table)
                    app.append_rows(rows)
                    app.flush()
            con.execute(_from_stage(batch.chunks))
            con.execute("DELETE FROM positions")
            if cursor.positions:
                con.executemany("INSERT INTO positions VALUES (?, ?)", sorted(cursor.positions.items()))
            con.execute(
                "INSERT OR REPLACE INTO projector_state VALUES (1, ?, ?, "
                "(SELECT count(*) FROM events) + (SELECT count(*) FROM unprojected_events), ?, ?)",
                [SCHEMA_VERSION, state.as_of, cursor.unprojected, checkpoint],
            )
            if before_commit is not None:
                before_commit()
            con.execute("COMMIT")
        except duckdb.Error as e:
            # A COMMIT that failed (disk full) has already ended the transaction;
            # the operator must see that cause, not "no transaction is active".
            with contextlib.suppress(duckdb.Error):
                con.execute("ROLLBACK")
            raise ProjectionError(f"cannot commit to {self.path}: {e}; nothing of this batch was written") from e

    def export_copy(self, dest: str | Path) -> Path:
        """Copy the database to ``dest`` atomically, for analysts to open read-only (in the DuckDB CLI too)."""
        dest = Path(dest)
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.unlink(missing_ok=True)
        name = self.con.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        self.con.execute(f"ATTACH '{tmp}' AS llmgw_copy (STORAGE_VERSION '{COPY_STORAGE_VERSION}')")
        try:
            self.con.execute(f'COPY FROM DATABASE "{name}" TO llmgw_copy')
        finally:
            self.con.execute("DETACH llmgw_copy")
        os.replace(tmp, dest)
        return dest

    def table_rows(self, table: str) -> list[tuple[Any, ...]]:
        """Every row of a table in a stable order (for comparing two stores)."""
        if table not in TABLES:
            raise ProjectionError(f"no table {table!r}; tables: {', '.join(TABLES)}")
        return sorted(self.con.execute(f"SELECT * FROM {table}").fetchall(), key=repr)

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        return self.con.execute(sql, params or []).fetchall()

    def usage(self, by: str, since_days: int) -> list[tuple[Any, ...]]:
        """``usage_rows`` from the file this store holds (its last commit): the running projector's answer."""
        try:
            return _usage(self.con, by, since_days)
        except duckdb.Error as e:
            raise ProjectionError(f"cannot read usage from {self.path}: {e}") from e


def _literal(path: Path) -> str:
    """A path as an SQL string literal (COPY takes no parameters)."""
    return "'" + str(path).replace("'", "''") + "'"


class DatabaseHeldError(ProjectionError):
    """Another process (a running projector) holds the file: DuckDB lets no one else open it."""


def _open_read_only(source: str | Path) -> duckdb.DuckDBPyConnection:
    """A projection opened read-only (one committed state); DatabaseHeldError while a projector holds it."""
    try:
        con = duckdb.connect(str(source), read_only=True)
        con.execute("SET enable_progress_bar = false")
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise DatabaseHeldError(f"{source} is held by another process: {e}") from e
        raise ProjectionError(f"cannot open {source}: {e}") from e
    return con


# What the export leaves out: the projector's own resume point (its fold holds the keys' salts and
# digests, which a resumed projector's snapshots must carry), and any key secret in a file a projector
# of before this rule wrote and none has opened since.
_EXPORTED = {
    "projector_state": 'SELECT * EXCLUDE (checkpoint) FROM "projector_state"',
    "events": f"SELECT * REPLACE (CASE WHEN type = 'KeyDeclared' THEN {KEY_PUBLIC} ELSE json END AS json) FROM events",
}


def copy_to_parquet(source: str | Path, dest: str | Path,
                    by_day: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int], datetime | None]:
    """Every table and view of ``source`` as Parquet under ``dest``; rows per table and per view, and the
    newest event time.

    ``by_day`` tables go to ``dest/<table>/day=YYYY-MM-DD/`` (the day of ``ts`` in
    UTC; hive partitioning, so a reader gets ``day`` back as a column), the others
    to ``dest/<table>.parquet``. The file is opened read-only, so the copy is of
    one committed state.
    """
    con = _open_read_only(source)
    dest = Path(dest)
    out: dict[str, int] = {}
    views_out: dict[str, int] = {}
    as_of = None
    try:
        dest.mkdir(parents=True, exist_ok=True)
        con.execute("SET TimeZone = 'UTC'")
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
                                           "ORDER BY table_name").fetchall()]
        if "projector_state" not in names:
            raise ProjectionError(f"{source} holds no llmgw projection (no projector_state table)")
        row = con.execute("SELECT as_of FROM projector_state WHERE id = 1").fetchone()
        as_of = row[0] if row else None
        for table in names:
            out[table] = con.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]  # type: ignore[index]
            rows = _EXPORTED.get(table, f'SELECT * FROM "{table}"')
            if table in by_day:
                where = dest / table
                where.mkdir(parents=True, exist_ok=True)
                if out[table]:
                    con.execute(f"COPY (SELECT *, (ts AT TIME ZONE 'UTC')::DATE AS day FROM ({rows})) "
                                f"TO {_literal(where)} (FORMAT parquet, PARTITION_BY (day), OVERWRITE_OR_IGNORE)")
                else:  # one file with no rows: a reader's glob finds the table and its columns, not an error
                    (where / "day=1970-01-01").mkdir()
                    con.execute(f"COPY ({rows} LIMIT 0) TO "
                                f"{_literal(where / 'day=1970-01-01' / 'data_0.parquet')} (FORMAT parquet)")
            else:
                con.execute(f"COPY ({rows}) TO {_literal(dest / (table + '.parquet'))} (FORMAT parquet)")
        # The views too, as they read now (replica_lifetimes, gpu_hours_idle_daily, cold_starts, …): a tool
        # that reads Parquet has no SQL to run them with.
        views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal "
                                           "AND schema_name = 'main' ORDER BY view_name").fetchall()]
        for view in views:
            views_out[view] = con.execute(f'SELECT count(*) FROM "{view}"').fetchone()[0]  # type: ignore[index]
            con.execute(f"COPY (SELECT * FROM \"{view}\") TO {_literal(dest / (view + '.parquet'))} (FORMAT parquet)")
    except (duckdb.Error, OSError) as e:
        raise ProjectionError(f"cannot export {source} to {dest}: {e}") from e
    finally:
        con.close()
    return out, views_out, as_of


USAGE_BY = {"key": "key_name", "tenant": "tenant", "model": "model", "adapter": "adapter"}
# What a usage row holds after its name, in this order (``ctl usage --json``'s fields, the status service's rows).
USAGE_FIGURES = ("requests", "errors", "throttled", "forbidden", "prompt_tokens", "completion_tokens", "cached_tokens")


def _usage(con: duckdb.DuckDBPyConnection, by: str, since_days: int) -> list[tuple[Any, ...]]:
    """Requests, errors (of them 429s, 403s) and tokens per key, tenant, model or adapter over the last days (UTC)."""
    column = USAGE_BY[by]
    view = "usage_by_adapter_daily" if by == "adapter" else "usage_by_key_daily"
    sums = ", ".join(f"coalesce(sum({f}), 0)::BIGINT" for f in USAGE_FIGURES)
    return con.execute(
        f"SELECT {column}, {sums} FROM {view} WHERE day > (now() AT TIME ZONE 'UTC')::DATE - ?::INTEGER "
        # (``ORDER BY 6 + 7`` would be a constant, not two columns: the sum is spelt out.)
        "GROUP BY 1 ORDER BY coalesce(sum(prompt_tokens), 0) + coalesce(sum(completion_tokens), 0) DESC, 1",
        [since_days]).fetchall()


def usage_rows(source: str | Path, by: str, since_days: int) -> list[tuple[Any, ...]]:
    """``ctl usage`` from a file opened read-only (DatabaseHeldError while a projector holds it: ``Store.usage``)."""
    con = _open_read_only(source)
    try:
        return _usage(con, by, since_days)
    except duckdb.Error as e:
        raise ProjectionError(f"cannot read usage from {source}: {e}; is it a projection of this version?") from e
    finally:
        con.close()
