"""One line a person can read per event: what ``llmgw replay`` prints and the scheduler logs."""

from __future__ import annotations

from llmgw.messages import control as c
from llmgw.messages import fleet as f
from llmgw.messages import usage as u
from llmgw.messages.base import Event


def describe(event: Event) -> str:
    """One line a person can read: what happened, with the numbers."""
    match event:
        case f.NodeInventoryReported():
            bad = [str(g.index) for g in event.gpus if not g.healthy]
            classes = ",".join(sorted({g.gpu_class for g in event.gpus})) or "-"
            extra = f", unhealthy: {' '.join(bad)}" if bad else ""
            return f"node {event.node} reported {len(event.gpus)} × {classes} on fabric {event.fabric}{extra}"
        case f.GpuHealthChanged():
            word = "healthy again" if event.healthy else "UNHEALTHY"
            why = f" ({', '.join(event.reasons)})" if event.reasons else ""
            return f"node {event.node} GPU {event.gpu_index} {word}{why}"
        case f.NodeLost():
            return f"node {event.node} LOST (no heartbeat for {event.timeout_s:.0f}s)"
        case f.NodeReturned():
            return f"node {event.node} returned"
        case f.NodeRetired():
            return f"node {event.node} retired by an operator" + (f": {event.reason}" if event.reason else "")
        case f.NodeFilesReported():
            done = sum(1 for h in event.sources if h.complete)
            return (f"node {event.node} holds {len(event.sources)} model source{'s' if len(event.sources) != 1 else ''} "
                    f"({done} complete, {_size(sum(h.size for h in event.sources))})"
                    + (" and more not listed" if event.truncated else ""))
        case f.DownloadProgressed():
            share = f" ({event.done * 100 // event.total}%)" if event.total else ""
            return (f"node {event.node} fetching {event.source} for {event.model}: {_size(event.done)} of "
                    f"{_size(event.total)}{share} at {_size(int(event.rate))}/s")
        case f.DownloadFinished():
            if event.ok:
                again = f", {event.mismatches} refetched after a digest mismatch" if event.mismatches else ""
                return (f"node {event.node} fetched {event.source} for {event.model}: {event.files} file"
                        f"{'s' if event.files != 1 else ''}, {_size(event.size)} in {event.seconds:.1f}s, verified{again}")
            return f"node {event.node} did NOT fetch {event.source} for {event.model} ({event.code}): {event.reason}"
        case f.FilesEvicted():
            return f"node {event.node} evicted {event.source} ({_size(event.size)}, {event.store}): {event.reason}"
        case c.ModelPrefetchRequested():
            return f"model {event.name}: prefetch asked of {', '.join(event.nodes) or 'every node'}"
        case c.ModelPinned():
            return f"model {event.name} {'pinned: its files stay on disk' if event.pinned else 'unpinned'}"
        case c.ModelDeclared(spec=s):
            return (f"model {s.name} declared: {s.replicas} × {s.gpu_class} tp{s.tp} pp{s.pp} "
                    f"{s.precision} ({s.engine})")
        case c.ModelScaled():
            return f"model {event.name} scaled to {event.replicas} replica{'s' if event.replicas != 1 else ''}"
        case c.ModelAutoscaled():
            return (f"model {event.name} autoscaled to {event.replicas} replica{'s' if event.replicas != 1 else ''}: "
                    f"{event.reason}")
        case u.ModelWanted():
            return (f"router {event.router} wants model {event.model}: {event.waiting} request"
                    f"{'s' if event.waiting != 1 else ''} waiting (it had seen control up to #{event.control_seq})")
        case c.ModelRemoved():
            return f"model {event.name} removed"
        case c.ModelUnplaceable():
            return f"model {event.name} UNPLACEABLE ({event.missing_replicas} missing): {event.reason}"
        case c.ReplicaPlaced():
            why = f" ({event.reason})" if event.reason else ""
            return (f"replica {event.replica_id} of {event.model} placed on {','.join(event.nodes)} "
                    f"({len(event.gpus)} GPU{'s' if len(event.gpus) != 1 else ''}, fabric {event.fabric or '-'}){why}")
        case c.ReplicaStateChanged():
            detail = f": {event.detail}" if event.detail else ""
            kv = f" (reserved {event.observed_kv_tokens:,} KV tokens)" if event.observed_kv_tokens > 0 else ""
            return f"replica {event.replica_id} of {event.model} on {event.node} is {event.state}{kv}{detail}"
        case c.ReplicaStopped():
            return f"replica {event.replica_id} of {event.model} stopped: {event.reason}"
        case c.ControlPlaneStopped():
            return f"control plane {event.boot_id} STOPPED" + (f" ({event.reason})" if event.reason else "") + \
                ": nothing serves and no GPU-hours count until it starts again"
        case c.ControlPlaneStarted():
            if event.last_seen is not None:
                down = (event.at - event.last_seen).total_seconds()
                return (f"control plane {event.boot_id} started; the one before ({event.previous_boot_id or '?'}) "
                        f"stopped unrecorded, last seen {event.last_seen:%Y-%m-%d %H:%M:%S} UTC: down {down:,.0f}s")
            return f"control plane {event.boot_id} started"
        case u.WakeAnswered():
            held = (event.released_at - event.held_since).total_seconds()
            return (f"router {event.router} sent {event.requests} held request{'s' if event.requests != 1 else ''} "
                    f"for {event.model} on to {event.replica_id} (held {held:.2f}s; first byte "
                    f"{(event.at - event.released_at).total_seconds():.2f}s later)")
        case u.IdleMapPublished():
            return (f"router {event.router} tick {event.tick}: {len(event.last_request)} replicas with requests, "
                    f"{len(event.serving_since)} without since routing began")
    return type(event).__name__


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
