"""The DuckDB schema analysts read: tables, views, and a comment on every one of their columns.

Plain text, no duckdb: the store runs it (``statements``), and docs/data.md
explains the same names. Naming, once for all tables and views:

* a node is ``node``, a model ``model``, a replica ``replica_id``, a GPU
  ``gpu_index`` on its node and ``gpu_uuid`` everywhere: the same name in every
  table, so that ``JOIN … USING (node)`` works;
* ``ts`` is when the row's event happened (``at`` is a reserved word in DuckDB's
  SQL); other moments end in ``_at`` (``stored_at``, ``placed_at``) or say what
  they are (``since``, ``last_request``);
* ``gpus`` is only the table of GPUs; a number of GPUs is ``gpu_count``;
* several nodes or reasons are a ``VARCHAR[]`` list, never a joined string;
* an unknown idle time is NULL (unknown is not idle), never a number;
* ``stream`` holds the JetStream stream's name (``LLMGW_FLEET``), as ``nats``
  and ``ctl status --json`` show it; the CLI's flags take it or ``fleet``.
"""

from __future__ import annotations

# A stretch without requests counts as idle in ``gpu_hours_idle_daily`` from this long on:
# the default of ``llmgw ctl idle --older-than``, so that both answer the same question.
IDLE_AFTER_S = 1800

# Columns that mean the same in every table that has them.
_COMMON = {
    "stream": "JetStream stream holding the message: LLMGW_FLEET, LLMGW_CONTROL or LLMGW_USAGE "
              "(the CLI's fleet, control, usage)",
    "seq": "sequence of the message in its stream; (stream, seq) names one message",
    "ts": "when the event happened: its `at` as its publisher set it, or stored_at when that is more than "
          "5 minutes later or 10 years earlier than stored_at (a wrong clock)",
    "node": "node name",
    "model": "model name (as declared with llmgw ctl model deploy)",
    "replica_id": "replica id, <model>-r<n>: the n-th replica ever placed for the model",
    "gpu_index": "the GPU's index on its node (NVML's)",
    "gpu_uuid": "the GPU's UUID (GPU-…), which follows the card when indices change",
    "gpu_count": "number of GPUs",
    "healthy": "whether the GPU may be used (unhealthy GPUs are neither used nor free)",
    "reasons": "why, as the agent reported it, e.g. 'xid 79: GPU has fallen off the bus'; empty when nothing is wrong",
}

# table -> (what one row is, [(column, type, comment or None for _COMMON's)])
TABLES: dict[str, tuple[str, list[tuple[str, str, str | None]]]] = {
    "positions": ("Bookkeeping: the last sequence of each stream this file holds, written in the same "
                  "transaction as the rows.", [
        ("stream", "VARCHAR PRIMARY KEY", None),
        ("seq", "BIGINT NOT NULL", "the last sequence of the stream folded into this file"),
    ]),
    "projector_state": ("Bookkeeping: one row (id 1), what a resumed projector starts from.", [
        ("id", "INTEGER PRIMARY KEY", "always 1"),
        ("schema_version", "INTEGER", "schema of this file (SCHEMA_VERSION in projections/store.py); a projector "
                                      "refuses another and says to project into a new file"),
        ("as_of", "TIMESTAMPTZ", "the newest event time folded"),
        ("events", "BIGINT", "rows in events plus rows in unprojected_events"),
        ("unprojected", "BIGINT", "messages that could not be decoded or were refused (ctl status counts them)"),
        ("checkpoint", "BLOB", "the folded state, its cursor, the models' history and the services' memory, "
                               "msgpack (llmgw.fleet.fold.Checkpoint)"),
    ]),
    "events": ("History: one row per event folded.", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("subject", "VARCHAR", "the NATS subject it was published on"),
        ("type", "VARCHAR", "the event's tag: NodeInventoryReported, GpuHealthChanged, ReplicaPlaced, …"),
        ("ts", "TIMESTAMPTZ", None),
        ("stored_at", "TIMESTAMPTZ", "when NATS stored the message"),
        ("node", "VARCHAR", "the node the event is about (ReplicaPlaced: its first node), else NULL"),
        ("model", "VARCHAR", "the model the event is about, else NULL"),
        ("replica_id", "VARCHAR", "the replica the event is about, else NULL"),
        ("json", "VARCHAR", "the event as published (JSON; json->>'reason'); NULL for IdleMapPublished, "
                            "whose content is in idle_history; a KeyDeclared without its salt and digest"),
    ]),
    "gpu_health": ("History: one row per GpuHealthChanged, a GPU whose health or reasons changed (only "
                   "changes are events; a node's inventory reports them all, see gpu_faults).", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("node", "VARCHAR", None),
        ("gpu_index", "INTEGER", None),
        ("gpu_uuid", "VARCHAR", None),
        ("healthy", "BOOLEAN", None),
        ("reasons", "VARCHAR[]", None),
        ("xid", "INTEGER", "the XID number its reasons name (xid 79: fallen off the bus), else NULL"),
    ]),
    "replica_lifecycle": ("History: one row per ReplicaPlaced, ReplicaStateChanged and ReplicaStopped.", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("replica_id", "VARCHAR", None),
        ("model", "VARCHAR", None),
        ("kind", "VARCHAR", "placed, state (a state report) or stopped"),
        ("state", "VARCHAR", "placed, stopped, or the state reported: starting, healthy, unhealthy, failed"),
        ("nodes", "VARCHAR[]", "placed: every node of the replica; state: the node that reported; stopped: NULL"),
        ("gpu_count", "INTEGER", "placed: the GPUs the replica holds; else NULL"),
        ("detail", "VARCHAR", "state: the engine's detail; placed and stopped: why, e.g. "
                              "'woken by router-a: 3 requests waiting', 'idle'"),
        ("code", "VARCHAR", "stopped: why, as a code to group by (idle, scaled_down, spec_changed, removed, "
                            "gpu_unhealthy, node_lost, engine_failed, requested); else NULL"),
    ]),
    "idle_history": ("History: one row per change of one router's idle-map entry for one replica (it appeared, "
                     "its last request moved, it vanished, or the router restarted); unchanged entries are "
                     "not repeated every tick.", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("router", "VARCHAR", "the router whose map this is"),
        ("tick", "BIGINT", "the router's tick (counts from 1 again when it restarts)"),
        ("replica_id", "VARCHAR", None),
        ("last_request", "TIMESTAMPTZ", "the router's latest request to the replica; NULL: none it knows of"),
        ("serving_since", "TIMESTAMPTZ", "when the router began routing to the replica, while it has sent it "
                                         "no request; else NULL"),
        ("idle_s", "DOUBLE", "seconds from the newer of last_request and serving_since to ts; NULL: this router "
                             "knows nothing of the replica (unknown is not idle)"),
    ]),
    "prefix_cache": ("History: per router tick and replica that answered with usage, the prompt tokens its "
                     "engine reported and how many it served from its prefix cache (the router's idle map, "
                     "cache_use; issue 27's routing).", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("router", "VARCHAR", "the router whose map this is"),
        ("replica_id", "VARCHAR", None),
        ("model", "VARCHAR", None),
        ("prompt_tokens", "BIGINT", "prompt tokens its engine reported over the tick (usage.prompt_tokens)"),
        ("cached_tokens", "BIGINT", "of them, served from the engine's prefix cache (vLLM cached_tokens, "
                                    "llama-server timings.cache_n)"),
    ]),
    "usage_by_key": ("History: per router tick, API key (ctl key) and model, what was asked through the router "
                     "(the idle map's callers): requests, errors, the engines' token counts, time sums.", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("router", "VARCHAR", "the router whose map this is"),
        ("key_name", "VARCHAR", "the API key's name (ctl key list)"),
        ("model", "VARCHAR", None),
        ("requests", "BIGINT", "requests answered over the tick"),
        ("errors", "BIGINT", "of them, answered 4xx or 5xx"),
        ("prompt_tokens", "BIGINT", "prompt tokens the engines reported (usage)"),
        ("completion_tokens", "BIGINT", "completion tokens the engines reported"),
        ("cached_tokens", "BIGINT", "prompt tokens served from the engines' prefix cache"),
        ("ttft_s", "DOUBLE", "time to first token, summed over its streamed requests (seconds)"),
        ("latency_s", "DOUBLE", "time to the last byte, summed over its requests (seconds)"),
        ("throttled", "BIGINT", "of the errors, answered 429 (the key's rate or quota, the model at capacity); "
                                "NULL: projected before schema 7, when they were only in errors"),
        ("forbidden", "BIGINT", "of the errors, answered 403 (a model the key may not use); NULL: projected "
                                "before schema 7"),
    ]),
    "gpu_bookings": ("History: one row per GPU of each ReplicaPlaced (what the replica booked on it) and of the "
                     "ReplicaStopped that freed it; several replicas share a card while their bookings fit its memory "
                     "(gpu_booked_used sums them over time).", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", "sequence of the ReplicaPlaced or ReplicaStopped in its stream"),
        ("ts", "TIMESTAMPTZ", None),
        ("node", "VARCHAR", None),
        ("gpu_index", "INTEGER", None),
        ("gpu_uuid", "VARCHAR", None),
        ("replica_id", "VARCHAR", None),
        ("model", "VARCHAR", None),
        ("event", "VARCHAR", "placed (the replica booked the GPU) or stopped (it freed it)"),
        ("booked_mib", "BIGINT", "MiB the replica booked on this GPU; a placement from before GPUs were shared "
                                 "booked the whole card (its memory_mib); NULL: a whole card no inventory in "
                                 "this file names"),
        ("memory_mib", "BIGINT", "the card's memory in MiB, as its node's inventory reports it; NULL: unknown"),
    ]),
    "replica_memory": ("History: one row per report of the GPU memory a replica's engine holds on one node: "
                       "a ReplicaStateChanged that carries it (the agent reports it again when it moves) or a "
                       "ReplicaOverBooked (it went more than 10 % past what the replica booked there).", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("ts", "TIMESTAMPTZ", None),
        ("replica_id", "VARCHAR", None),
        ("model", "VARCHAR", None),
        ("node", "VARCHAR", "the node whose agent measured it"),
        ("used_mib", "BIGINT", "MiB the engine's processes (and their children) hold on the node's GPUs: NVML's "
                               "figure, or on a simulated GPU their resident memory"),
        ("kind", "VARCHAR", "state (a ReplicaStateChanged) or overbooked (a ReplicaOverBooked)"),
    ]),
    "unprojected_events": ("History: one row per message kept but not folded (undecodable, out of bounds, "
                           "refused; counted in ctl status), or, with error starting 'the store cannot write "
                           "it:', a decoded event whose history rows DuckDB refused (folded; not counted).", [
        ("stream", "VARCHAR", None),
        ("seq", "BIGINT", None),
        ("subject", "VARCHAR", "the NATS subject it was published on"),
        ("raw", "BLOB", "the message as stored"),
        ("error", "VARCHAR", "why it was not folded"),
    ]),
    "nodes": ("Now (rebuilt at every commit): one row per node that reported an inventory.", [
        ("node", "VARCHAR", None),
        ("fabric", "VARCHAR", "the node's fabric (a replica never spans fabrics)"),
        ("fabric_source", "VARCHAR", "where the fabric came from: fleet-file, nvml, …"),
        ("boot_id", "VARCHAR", "the agent's boot id: changes when the agent restarts"),
        ("gpu_count", "INTEGER", "GPUs the node reported"),
        ("healthy_gpu_count", "INTEGER", "of those, healthy"),
        ("lost", "BOOLEAN", "missed its heartbeats (NodeLost) and has not reported since"),
        ("lost_at", "TIMESTAMPTZ", "when it was lost; NULL when not lost"),
        ("simulated", "BOOLEAN", "a simulated node (llmgw agent --simulate)"),
        ("updated_at", "TIMESTAMPTZ", "the newest event about the node"),
    ]),
    "gpus": ("Now (rebuilt at every commit): one row per GPU of every node.", [
        ("node", "VARCHAR", None),
        ("gpu_index", "INTEGER", None),
        ("gpu_uuid", "VARCHAR", None),
        ("gpu_name", "VARCHAR", "the product name NVML reports, e.g. NVIDIA H100 80GB HBM3"),
        ("gpu_class", "VARCHAR", "what models are placed by, e.g. H100-80GB"),
        ("memory_mib", "BIGINT", "memory in MiB"),
        ("healthy", "BOOLEAN", None),
        ("reasons", "VARCHAR[]", None),
        ("since", "TIMESTAMPTZ", "when its current health and reasons were first reported"),
        ("replica_ids", "VARCHAR[]", "the replicas booked on it, in placement order (several share a card while "
                                     "their bookings fit); empty: not held"),
        ("booked_mib", "BIGINT", "MiB those replicas booked on it (a whole-GPU replica: the card); 0: not held"),
    ]),
    "replicas": ("Now (rebuilt at every commit): one row per replica placed and not stopped.", [
        ("replica_id", "VARCHAR", None),
        ("model", "VARCHAR", None),
        ("state", "VARCHAR", "placed, starting, healthy, unhealthy or failed"),
        ("nodes", "VARCHAR[]", "its nodes (the first runs the head)"),
        ("gpu_count", "INTEGER", "GPUs it holds"),
        ("fabric", "VARCHAR", "the fabric of its nodes"),
        ("placed_at", "TIMESTAMPTZ", "when it was placed"),
        ("state_at", "TIMESTAMPTZ", "when its state last changed"),
        ("endpoint", "VARCHAR", "where the router sends its requests; empty until it serves"),
        ("restarts", "INTEGER", "engine restarts its agent reported"),
        ("idle_since", "TIMESTAMPTZ", "since when nobody has asked for it; NULL: no router knows (unknown is "
                                      "not idle)"),
    ]),
    "models": ("Now (rebuilt at every commit): one row per declared model.", [
        ("model", "VARCHAR", None),
        ("engine", "VARCHAR", "vllm or llama.cpp (a precision carries its engine)"),
        ("precision", "VARCHAR", "bf16, fp8, awq, q4_K_M, …"),
        ("gpu_class", "VARCHAR", "the GPU class it runs on"),
        ("tp", "INTEGER", "tensor-parallel ranks per replica"),
        ("pp", "INTEGER", "pipeline-parallel stages per replica"),
        ("replicas_wanted", "INTEGER", "replicas declared, scaled or autoscaled to"),
        ("replicas_placed", "INTEGER", "replicas placed now"),
        ("declared_at", "TIMESTAMPTZ", "when it was last declared"),
    ]),
    "unplaceable": ("Now (rebuilt at every commit): declared models the scheduler could not place, and why.", [
        ("model", "VARCHAR", None),
        ("reason", "VARCHAR", "why, with the numbers"),
        ("since", "TIMESTAMPTZ", "when the scheduler said so"),
    ]),
}

# name -> (what one row is, its SELECT, {column: comment or None for _COMMON's}). In the order
# created: a view reads only tables and the views before it. Each works in the DuckDB CLI the
# snapshot is written for (docs/data.md), and gives the same answer in any session time zone.
VIEWS: dict[str, tuple[str, str, dict[str, str | None]]] = {
    "replica_lifetimes": ("One row per replica placed in this history: where, how many GPUs, from when to when.", """
SELECT replica_id, any_value(model) AS model,
       any_value(nodes) FILTER (kind = 'placed') AS nodes,
       any_value(gpu_count) FILTER (kind = 'placed') AS gpu_count,
       min(ts) FILTER (kind = 'placed') AS placed_at,
       min(ts) FILTER (kind = 'stopped') AS stopped_at,
       arg_min(detail, ts) FILTER (kind = 'stopped') AS stop_reason
FROM replica_lifecycle GROUP BY replica_id HAVING count(*) FILTER (kind = 'placed') > 0
""", {"replica_id": None, "model": None, "nodes": "its nodes (the first runs the head)",
      "gpu_count": "GPUs it held", "placed_at": "when it was placed",
      "stopped_at": "when it was stopped (its GPUs freed); NULL: still placed",
      "stop_reason": "why it was stopped, e.g. idle, scaled down to 1; NULL: still placed"}),

    "replica_gpus": ("One row per GPU a replica held: which card, from when to when.", """
SELECT p.replica_id, p.model, p.node, p.gpu_index, p.gpu_uuid, l.placed_at, l.stopped_at
FROM (SELECT replica_id, model, g.node AS node, g.index AS gpu_index, g.uuid AS gpu_uuid
      FROM (SELECT replica_id, model,
                   unnest(from_json(json->'gpus', '[{"node": "VARCHAR", "index": "INTEGER", "uuid": "VARCHAR"}]')) AS g
            FROM events WHERE type = 'ReplicaPlaced')) p
JOIN replica_lifetimes l USING (replica_id)
""", {"replica_id": None, "model": None, "node": None, "gpu_index": None, "gpu_uuid": None,
      "placed_at": "when the replica took the GPU", "stopped_at": "when it freed it; NULL: it still holds it"}),

    "replica_idle_intervals": ("One row per stretch in which nobody asked for a replica: from a request (or "
                               "the moment the first router began routing to it) to the next one any router saw, "
                               "its stop, or the newest event. A router that begins routing later (a new name) "
                               "asked nothing: it starts no stretch. Before the first, idleness is unknown: not a "
                               "row.", """
WITH firsts AS (
    SELECT replica_id, min(last_request) AS first_request, min(serving_since) AS first_serving
    FROM idle_history GROUP BY replica_id
), activity AS (
    SELECT DISTINCT replica_id, t FROM (
        SELECT replica_id, last_request AS t FROM idle_history WHERE last_request IS NOT NULL
        UNION ALL
        SELECT replica_id, first_serving FROM firsts
        WHERE first_serving IS NOT NULL AND (first_request IS NULL OR first_serving < first_request))
), stretches AS (
    SELECT replica_id, t AS idle_from, lead(t) OVER (PARTITION BY replica_id ORDER BY t) AS next_t FROM activity
), newest AS (
    SELECT max(ts) AS newest FROM events
)
SELECT s.replica_id, l.model, l.gpu_count, s.idle_from, coalesce(s.next_t, l.stopped_at, n.newest) AS idle_to,
       epoch(idle_to - s.idle_from) AS idle_s, s.next_t IS NULL AND l.stopped_at IS NULL AS ongoing
FROM stretches s JOIN replica_lifetimes l USING (replica_id) CROSS JOIN newest n
WHERE idle_to > s.idle_from
""", {"replica_id": None, "model": None, "gpu_count": "GPUs the replica held meanwhile",
      "idle_from": "a request, or when the first router began routing to the replica",
      "idle_to": "the next request any router saw; the replica's stop; or the newest event in the file",
      "idle_s": "seconds idle (idle_to - idle_from)",
      "ongoing": "true when still idle at the newest event (idle_to is that event's time)"}),

    "control_plane_outages": ("One row per gap the control plane (llmgw up) was down: from its recorded stop "
                              "(SIGTERM, Ctrl-C), or from when it was last seen before a stop nothing recorded "
                              "(kill -9, a power cut), to its next start. No replica served and no GPU was held "
                              "then: chargeback_daily leaves these hours out.", """
SELECT down_from, down_to, epoch(down_to - down_from) AS down_s, boot_id, recorded
FROM (SELECT CASE WHEN before_type = 'ControlPlaneStopped' THEN before_ts
                  ELSE greatest(last_seen, before_ts) END AS down_from,
             ts AS down_to, boot_id, coalesce(before_type = 'ControlPlaneStopped', false) AS recorded
      FROM (SELECT ts, type, json->>'boot_id' AS boot_id, TRY_CAST(json->>'last_seen' AS TIMESTAMPTZ) AS last_seen,
                   lag(type) OVER (ORDER BY seq) AS before_type, lag(ts) OVER (ORDER BY seq) AS before_ts
            FROM events WHERE type IN ('ControlPlaneStopped', 'ControlPlaneStarted'))
      WHERE type = 'ControlPlaneStarted' AND (before_type = 'ControlPlaneStopped' OR last_seen IS NOT NULL))
WHERE down_from < down_to
""", {"down_from": "when it went down: its recorded stop, else when it was last seen (the next start's last_seen)",
      "down_to": "when it started again", "down_s": "seconds down",
      "boot_id": "the boot of the start that ended the gap",
      "recorded": "true: the stop was recorded; false: only the next start said (kill -9)"}),

    "gpu_hours_idle_daily": (f"GPU-hours per model and day (UTC) that replicas sat idle in stretches of "
                             f"{IDLE_AFTER_S // 60} minutes or more (llmgw ctl idle's default --older-than), "
                             "a stretch split at midnight, the control plane's outages left out. For another "
                             "threshold, filter replica_idle_intervals.",
                             f"""
WITH gaps AS (
    SELECT down_from AT TIME ZONE 'UTC' AS down_from, down_to AT TIME ZONE 'UTC' AS down_to FROM control_plane_outages
)
SELECT model, day::DATE AS day,
       sum(gpu_count * (epoch(least(t, day + INTERVAL 1 DAY) - greatest(f, day)) - down_s)) / 3600 AS gpu_hours_idle
FROM (SELECT *, coalesce((SELECT sum(epoch(least(t, day + INTERVAL 1 DAY, g.down_to) - greatest(f, day, g.down_from)))
                          FROM gaps g WHERE g.down_from < least(t, day + INTERVAL 1 DAY)
                            AND g.down_to > greatest(f, day)), 0) AS down_s
      FROM (SELECT model, gpu_count, f, t, unnest(range(date_trunc('day', f), t, INTERVAL 1 DAY)) AS day
            FROM (SELECT model, gpu_count, idle_from AT TIME ZONE 'UTC' AS f, idle_to AT TIME ZONE 'UTC' AS t
                  FROM replica_idle_intervals WHERE idle_s >= {IDLE_AFTER_S})))
GROUP BY model, day
""", {"model": None, "day": "the day (UTC)",
      "gpu_hours_idle": "GPUs held × hours idle that day"}),

    "prefix_cache_daily": ("The engines' prefix-cache hit rate per model, replica and day (UTC): prompt tokens "
                           "and the share served from cache, from the routers' maps.", """
SELECT model, replica_id, (ts AT TIME ZONE 'UTC')::DATE AS day, sum(prompt_tokens) AS prompt_tokens,
       sum(cached_tokens) AS cached_tokens, sum(cached_tokens) / nullif(sum(prompt_tokens), 0) AS cached_share
FROM prefix_cache GROUP BY ALL
""", {"model": None, "replica_id": None, "day": "the day (UTC)", "prompt_tokens": "prompt tokens reported that day",
      "cached_tokens": "of them, served from the engine's cache", "cached_share": "cached / prompt; NULL: none"}),

    "usage_by_key_daily": ("Per day (UTC), API key, its tenant (the key's latest declaration) and model: "
                           "requests, errors and tokens, from the routers' maps.", """
WITH tenants AS (
    SELECT json->>'name' AS key_name, arg_max(json->>'tenant', seq) AS tenant
    FROM events WHERE type = 'KeyDeclared' GROUP BY 1
)
SELECT (u.ts AT TIME ZONE 'UTC')::DATE AS day, u.key_name, coalesce(t.tenant, '') AS tenant, u.model,
       sum(u.requests) AS requests, sum(u.errors) AS errors, sum(u.throttled) AS throttled,
       sum(u.forbidden) AS forbidden, sum(u.prompt_tokens) AS prompt_tokens,
       sum(u.completion_tokens) AS completion_tokens, sum(u.cached_tokens) AS cached_tokens,
       sum(u.latency_s) / nullif(sum(u.requests), 0) AS mean_latency_s
FROM usage_by_key u LEFT JOIN tenants t USING (key_name)
GROUP BY ALL
""", {"day": "the day (UTC)", "key_name": "the API key's name", "tenant": "its tenant ('' when none)",
      "model": None, "requests": "requests answered", "errors": "of them, 4xx or 5xx",
      "throttled": "of the errors, 429s (rate, quota, capacity); NULL: only rows projected before schema 7",
      "forbidden": "of the errors, 403s (a model the key may not use); NULL: as throttled",
      "prompt_tokens": "prompt tokens (engines' usage)", "completion_tokens": "completion tokens",
      "cached_tokens": "prompt tokens from the prefix cache", "mean_latency_s": "mean time to the last byte"}),

    "usage_by_adapter_daily": ("Per day (UTC), LoRA adapter (ctl adapter add) and its base: what was asked for "
                               "it through the routers by API keys, from the routers' maps.", """
WITH adapters AS (
    SELECT json->'spec'->>'name' AS model, arg_max(json->'spec'->>'base', seq) AS base
    FROM events WHERE type = 'AdapterDeclared' GROUP BY 1
)
SELECT (u.ts AT TIME ZONE 'UTC')::DATE AS day, u.model AS adapter, a.base, u.key_name,
       sum(u.requests) AS requests, sum(u.errors) AS errors, sum(u.throttled) AS throttled,
       sum(u.forbidden) AS forbidden, sum(u.prompt_tokens) AS prompt_tokens,
       sum(u.completion_tokens) AS completion_tokens, sum(u.cached_tokens) AS cached_tokens
FROM usage_by_key u JOIN adapters a USING (model)
GROUP BY ALL
""", {"day": "the day (UTC)", "adapter": "the adapter's name, as a request's model names it",
      "base": "the declared model it runs on", "key_name": "the API key's name", "requests": "requests answered",
      "errors": "of them, 4xx or 5xx", "throttled": "of the errors, 429s", "forbidden": "of the errors, 403s", "prompt_tokens": "prompt tokens (engines' usage)",
      "completion_tokens": "completion tokens", "cached_tokens": "prompt tokens from the prefix cache"}),

    "adapter_idle": ("One row per LoRA adapter declared now: when anyone last asked for it through the routers "
                     "(any caller, anonymous ones too) and for how long nobody has, as of the newest event.", """
WITH declared AS (
    SELECT json->'spec'->>'name' AS adapter, arg_max(json->'spec'->>'base', seq) AS base,
           max(ts) AS declared_at
    FROM events WHERE type = 'AdapterDeclared' GROUP BY 1
), removed AS (
    SELECT json->>'name' AS adapter, max(ts) AS removed_at FROM events WHERE type = 'AdapterRemoved' GROUP BY 1
), asked AS (
    SELECT model AS adapter, max(ts) AS last_request FROM usage_by_key WHERE requests > 0 GROUP BY 1
)
SELECT d.adapter, d.base, a.last_request,
       epoch((SELECT max(ts) FROM events) - coalesce(a.last_request, d.declared_at)) AS idle_s
FROM declared d LEFT JOIN removed r USING (adapter) LEFT JOIN asked a USING (adapter)
WHERE r.removed_at IS NULL OR r.removed_at < d.declared_at
""", {"adapter": "the adapter's name", "base": "the declared model it runs on",
      "last_request": "when a router last counted a request for it (NULL: none in this history)",
      "idle_s": "seconds nobody has asked for it, to the newest event (since its declaration when never asked)"}),

    "chargeback_daily": ("Per day (UTC), model and tenant: the model's GPU-hours (busy and idle: every hour its "
                         "replicas held GPUs, the control plane's outages left out) split by each tenant's share "
                         "of its tokens that day; a day with no tokens is the tenant '' (nobody to charge). Sums "
                         "to the model's GPU-hours.", """
WITH gaps AS (
    SELECT down_from AT TIME ZONE 'UTC' AS down_from, down_to AT TIME ZONE 'UTC' AS down_to FROM control_plane_outages
), held AS (
    SELECT model, day::DATE AS day,
           sum(gpu_count * (epoch(least(t, day + INTERVAL 1 DAY) - greatest(f, day)) - down_s)) / 3600 AS gpu_hours
    FROM (SELECT *, coalesce((SELECT sum(epoch(least(t, day + INTERVAL 1 DAY, g.down_to) - greatest(f, day, g.down_from)))
                              FROM gaps g WHERE g.down_from < least(t, day + INTERVAL 1 DAY)
                                AND g.down_to > greatest(f, day)), 0) AS down_s
          FROM (SELECT model, gpu_count, f, t, unnest(range(date_trunc('day', f), t, INTERVAL 1 DAY)) AS day
                FROM (SELECT model, gpu_count, placed_at AT TIME ZONE 'UTC' AS f,
                             coalesce(stopped_at, (SELECT max(ts) FROM events)) AT TIME ZONE 'UTC' AS t
                      FROM replica_lifetimes WHERE gpu_count IS NOT NULL)))
    WHERE t > f
    GROUP BY ALL
), tokens AS (
    SELECT day, model, tenant, sum(prompt_tokens + completion_tokens) AS tokens
    FROM usage_by_key_daily GROUP BY ALL HAVING sum(prompt_tokens + completion_tokens) > 0
), shares AS (
    SELECT day, model, tenant, tokens / sum(tokens) OVER (PARTITION BY day, model) AS token_share FROM tokens
)
SELECT h.day, h.model, coalesce(s.tenant, '') AS tenant, coalesce(s.token_share, 1.0) AS token_share,
       h.gpu_hours * coalesce(s.token_share, 1.0) AS gpu_hours
FROM held h LEFT JOIN shares s USING (day, model)
""", {"day": "the day (UTC)", "model": None, "tenant": "the keys' tenant; '' for hours no token paid for",
      "token_share": "its share of the model's tokens that day", "gpu_hours": "GPUs held × hours, its share"}),

    "cold_starts": ("One row per wake (a request woke a parked model) and scale-up: each phase at its event's "
                    "time, from wanted to the first byte answered (the cold-start ledger, ctl model show).", """
WITH placed AS (
    SELECT replica_id, model, ts AS placed_at,
           coalesce(nullif(json->>'cause', ''),
                    CASE WHEN json->>'reason' LIKE 'woken by%' THEN 'wake'
                         WHEN json->>'reason' LIKE 'scaled up%' THEN 'scale-up' END) AS cause
    FROM events WHERE type = 'ReplicaPlaced'
), states AS (
    SELECT replica_id, min(ts) FILTER (state = 'starting') AS started_at,
           min(ts) FILTER (state = 'healthy') AS healthy_at
    FROM replica_lifecycle WHERE kind = 'state' GROUP BY replica_id
), answered AS (
    SELECT json->>'replica_id' AS replica_id, min((json->>'held_since')::TIMESTAMPTZ) AS wanted_at,
           min((json->>'released_at')::TIMESTAMPTZ) AS released_at, min(ts) AS first_byte_at,
           sum((json->>'requests')::INTEGER)::INTEGER AS requests
    FROM events WHERE type = 'WakeAnswered' GROUP BY 1
)
SELECT p.model, p.replica_id, p.cause,
       CASE WHEN p.cause = 'scale-up' THEN p.placed_at ELSE a.wanted_at END AS wanted_at,
       p.placed_at, s.started_at, s.healthy_at, a.released_at, a.first_byte_at,
       coalesce(a.requests, 0) AS requests,
       epoch(coalesce(a.first_byte_at, s.healthy_at) - coalesce(a.wanted_at, p.placed_at)) AS total_s
FROM placed p LEFT JOIN states s USING (replica_id) LEFT JOIN answered a USING (replica_id)
WHERE p.cause IS NOT NULL
""", {"model": None, "replica_id": None, "cause": "wake (a request woke a parked model) or scale-up (the autoscaler)",
      "wanted_at": "a wake: when the router held its first request; a scale-up: when it was placed; NULL: "
                   "no router said (an older router, or one that stopped before its next tick)",
      "placed_at": "when the scheduler placed the replica",
      "started_at": "when its agent reported the engine process starting; NULL: not reported",
      "healthy_at": "when its agent first reported it healthy; NULL: not yet",
      "released_at": "when the router sent the held requests on to it",
      "first_byte_at": "when the first byte of a held request's answer came back to the router",
      "requests": "requests held for it, over every router (0: none known)",
      "total_s": "seconds from wanted (else placed) to the first byte (else healthy); NULL: not yet healthy"}),

    "gpu_booked_used": ("One row per stretch in which a GPU's bookings and its replicas' measured use stayed the "
                        "same: who held it, what they booked, and what their engines held (how full the cards "
                        "really are). A replica's use on a node is split over its GPUs there as it booked them.", """
WITH holds AS (
    SELECT *, lead(ts) OVER (PARTITION BY replica_id, gpu_uuid ORDER BY seq) AS to_ts,
           booked_mib / sum(booked_mib) OVER (PARTITION BY stream, seq, node) AS node_share
    FROM gpu_bookings
), held AS (
    SELECT gpu_uuid, node, replica_id, booked_mib, node_share, ts AS from_ts, to_ts FROM holds WHERE event = 'placed'
), cards AS (
    SELECT gpu_uuid, arg_max(node, seq) AS node, arg_max(gpu_index, seq) AS gpu_index, max(memory_mib) AS memory_mib
    FROM gpu_bookings GROUP BY gpu_uuid
), points AS (
    SELECT gpu_uuid, ts FROM gpu_bookings
    UNION
    SELECT h.gpu_uuid, u.ts FROM replica_memory u
    JOIN held h ON u.replica_id = h.replica_id AND u.node = h.node AND u.ts >= h.from_ts
                   AND (h.to_ts IS NULL OR u.ts < h.to_ts)
), pairs AS (
    SELECT p.gpu_uuid, p.ts, h.replica_id, h.node, h.booked_mib, h.node_share, h.from_ts
    FROM points p JOIN held h ON h.gpu_uuid = p.gpu_uuid AND h.from_ts <= p.ts AND (h.to_ts IS NULL OR p.ts < h.to_ts)
), measured AS (
    SELECT r.*, CASE WHEN u.ts >= r.from_ts THEN u.used_mib * r.node_share END AS used
    FROM pairs r ASOF LEFT JOIN replica_memory u ON u.replica_id = r.replica_id AND u.node = r.node AND r.ts >= u.ts
), stretches AS (
    SELECT p.gpu_uuid, p.ts, coalesce(sum(x.booked_mib), 0)::BIGINT AS booked_mib, round(sum(x.used))::BIGINT AS used_mib,
           coalesce(list(x.replica_id ORDER BY x.from_ts, x.replica_id) FILTER (x.replica_id IS NOT NULL), [])
               AS replica_ids,
           count(x.replica_id) FILTER (x.used IS NULL)::INTEGER AS unmeasured
    FROM points p LEFT JOIN measured x ON x.gpu_uuid = p.gpu_uuid AND x.ts = p.ts
    GROUP BY p.gpu_uuid, p.ts
), newest AS (
    SELECT max(ts) AS newest FROM events
)
SELECT c.node, c.gpu_index, s.gpu_uuid, s.ts,
       coalesce(lead(s.ts) OVER (PARTITION BY s.gpu_uuid ORDER BY s.ts), n.newest) AS until,
       epoch(until - s.ts) AS span_s, c.memory_mib, s.booked_mib, s.used_mib, s.replica_ids, s.unmeasured
FROM stretches s JOIN cards c USING (gpu_uuid) CROSS JOIN newest n
""", {"node": None, "gpu_index": None, "gpu_uuid": None, "ts": "when the stretch began: a placement, a stop, or a "
                                                                 "replica's new measurement",
      "until": "when the next began; for the last, the newest event in the file",
      "span_s": "seconds the stretch lasted (until - ts)",
      "memory_mib": "the card's memory in MiB",
      "booked_mib": "MiB its replicas booked on it then; 0: none held it",
      "used_mib": "MiB their engines held on it then, as their agents last measured it (each replica's figure on "
                  "the node, split over its GPUs there by what it booked); NULL: none measured yet",
      "replica_ids": "the replicas booked on it then, in placement order",
      "unmeasured": "of them, those whose use no agent had reported yet (used_mib leaves them out)"}),

    "gpu_faults": ("One row per reason a GPU newly reported (XIDs, ECC errors, …): a GpuHealthChanged or a node's "
                   "inventory that names a reason the GPU's previous report did not, and the replica that held "
                   "the GPU then.", """
WITH reports AS (
    SELECT stream, seq, ts, node, gpu_index, gpu_uuid, healthy, reasons FROM gpu_health
    UNION ALL
    SELECT stream, seq, ts, node, g.index, g.uuid, coalesce(g.healthy, true), coalesce(g.reasons, [])
    FROM (SELECT stream, seq, ts, node,
                 unnest(from_json(json->'gpus',
                                  '[{"index": "INTEGER", "uuid": "VARCHAR", "healthy": "BOOLEAN", "reasons": ["VARCHAR"]}]'))
                     AS g
          FROM events WHERE type = 'NodeInventoryReported')
), news AS (
    SELECT *, lag(reasons, 1, []) OVER (PARTITION BY gpu_uuid ORDER BY ts, stream, seq) AS before FROM reports
), faults AS (
    SELECT ts, stream, seq, node, gpu_index, gpu_uuid, healthy,
           unnest(list_filter(reasons, lambda r: NOT list_contains(before, r))) AS reason
    FROM news
)
SELECT f.node, f.gpu_index, f.gpu_uuid, f.ts,
       CASE WHEN regexp_matches(reason, '^xid[ -]?[0-9]') THEN 'xid'
            WHEN reason ILIKE '%uncorrectable ECC%' THEN 'ecc-uncorrectable'
            WHEN reason ILIKE 'GPU is lost%' THEN 'gpu-lost'
            WHEN reason ILIKE 'thermal%' THEN 'thermal'
            WHEN reason ILIKE 'power-brake%' THEN 'power-brake'
            WHEN reason ILIKE 'retired pages pending%' THEN 'retired-pages-pending'
            WHEN reason ILIKE 'row remap pending%' THEN 'row-remap-pending'
            WHEN reason ILIKE 'row remap failed%' THEN 'row-remap-failed'
            WHEN reason ILIKE 'NVML recommends%' THEN 'recovery-action'
            ELSE 'other' END AS kind,
       try_cast(nullif(regexp_extract(reason, '^xid[ -]?([0-9]+)', 1), '') AS INTEGER) AS xid,
       f.reason, f.healthy, g.replica_id
FROM faults f
LEFT JOIN replica_gpus g
       ON g.gpu_uuid = f.gpu_uuid AND g.placed_at <= f.ts AND (g.stopped_at IS NULL OR f.ts < g.stopped_at)
""", {"node": None, "gpu_index": None, "gpu_uuid": None, "ts": "when it was reported",
      "kind": "xid, ecc-uncorrectable, gpu-lost, thermal, power-brake, retired-pages-pending, row-remap-pending, "
              "row-remap-failed, recovery-action or other (the agent's finding codes)",
      "xid": "the XID number for kind xid, else NULL",
      "reason": "the reason as the agent reported it",
      "healthy": "whether the GPU stayed usable (application XIDs and slowdowns do not make it unhealthy)",
      "replica_id": "the replica holding the GPU at the time; NULL: none"}),
}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def create_table(table: str) -> str:
    """The CREATE TABLE statement of one table (a migration adds a table with it)."""
    return f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{c} {t}' for c, t, _ in TABLES[table][1])})"


def statements() -> list[str]:
    """The tables (if absent), the views (replaced), and every comment, in order."""
    out = []
    for table, (what, cols) in TABLES.items():
        out.append(create_table(table))
        out.append(f"COMMENT ON TABLE {table} IS {_quote(what)}")
        out += [f"COMMENT ON COLUMN {table}.{c} IS {_quote(why or _COMMON[c])}" for c, _, why in cols]
    for view, (what, sql, view_cols) in VIEWS.items():
        out.append(f"CREATE OR REPLACE VIEW {view} AS {sql.strip()}")
        out.append(f"COMMENT ON VIEW {view} IS {_quote(what)}")
        out += [f"COMMENT ON COLUMN {view}.{c} IS {_quote(why or _COMMON[c])}" for c, why in view_cols.items()]
    return out
