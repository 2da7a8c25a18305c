"""Node maintenance the scheduler does itself: a node that loses a GPU to a fatal fault, or whose GPUs
fault N times in M minutes (``Quarantine``), is quarantined.

An operator cordons, drains and uncordons nodes (``ctl node``: ``NodeCordoned``/``NodeUncordoned``
on the control stream, folded into ``FleetState.cordoned``); placement takes nothing new to a
cordoned node, and a draining node's replicas are replaced elsewhere as a roll replaces a spec.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from llmgw import messages as m
from llmgw.fleet.state import FleetState, NodeView

# XIDs after which a GPU's node is taken out of placement until an operator looks (NVIDIA's "reset or
# reboot" class): 48 double-bit ECC, 79 fallen off the bus, 94/95 contained/uncontained ECC.
FATAL_XIDS = (48, 79, 94, 95)
_XID = re.compile(r"xid (\d+)\b")


@dataclass(frozen=True)
class Quarantine:
    """How many GPU faults (healthy → unhealthy, any reason) in how long quarantine a node; 0 faults: never."""

    faults: int = 3
    window_s: float = 3600.0


QUARANTINE = Quarantine()  # the default: 3 faults in 60 minutes


def quarantines(state: FleetState, now: datetime, policy: Quarantine = QUARANTINE) -> list[tuple[m.NodeCordoned, str]]:
    """A node that lost a GPU to a fatal XID, or whose GPUs went unhealthy ``policy.faults`` times in the
    last ``policy.window_s``, is cordoned (by "quarantine"), once per episode, with the reason; an operator
    who uncordons it after the faults has looked, and it is not cordoned again for them (only new faults
    that make the count again, or a new fatal XID, do)."""
    out = []
    for node in sorted(state.nodes.values(), key=lambda n: n.name):
        if node.name in state.cordoned or node.lost:
            continue
        for g in sorted(node.gpus.values(), key=lambda g: g.index):
            fatal = [r for r in g.reasons if (x := _XID.match(r.lower())) is not None and int(x[1]) in FATAL_XIDS]
            looked = state.uncordoned_at.get(node.name)
            if not g.healthy and fatal and (looked is None or g.since is None or looked < g.since):
                reason = f"quarantine: GPU {g.index} ({g.uuid}) {fatal[0]}; `llmgw ctl node uncordon {node.name}` after a look"
                event = m.NodeCordoned(at=now, node=node.name, reason=reason, by="quarantine")
                out.append((event, f"NodeCordoned:{node.name}:{g.uuid}:{_key(g.since, fatal[0])}"))
                break
        else:
            if policy.faults > 0 and (too_many := _too_many(state, node, now, policy)) is not None:
                out.append(too_many)
    return out


def _too_many(state: FleetState, node: NodeView, now: datetime, policy: Quarantine) -> tuple[m.NodeCordoned, str] | None:
    """The quarantine of a node whose GPUs faulted ``policy.faults`` times in the window (after its last uncordon)."""
    if not state.faults:
        return None
    since = now - timedelta(seconds=policy.window_s)
    looked = state.uncordoned_at.get(node.name)
    if looked is not None and looked > since:
        since = looked
    counts = [(g, state.recent_faults(g.uuid, since)) for g in sorted(node.gpus.values(), key=lambda g: g.index)]
    total = sum(n for _, n in counts)
    if total < policy.faults:
        return None
    last = max(t for g, _ in counts for t in state.faults.get(g.uuid, ()) if t > since)
    which = ", ".join(f"GPU {g.index} ×{n}" for g, n in counts if n)
    reason = (f"quarantine: {total} GPU faults in {_minutes(policy.window_s)} ({which}; the limit is "
              f"{policy.faults}); `llmgw ctl node uncordon {node.name}` after a look")
    event = m.NodeCordoned(at=now, node=node.name, reason=reason, by="quarantine")
    return event, f"NodeCordoned:{node.name}:faults:{_key(last, policy.faults, policy.window_s)}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min"


def _key(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()
