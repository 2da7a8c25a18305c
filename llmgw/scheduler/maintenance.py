"""Node maintenance the scheduler does itself: a node that loses a GPU to a fatal fault is quarantined.

An operator cordons, drains and uncordons nodes (``ctl node``: ``NodeCordoned``/``NodeUncordoned``
on the control stream, folded into ``FleetState.cordoned``); placement takes nothing new to a
cordoned node, and a draining node's replicas are replaced elsewhere as a roll replaces a spec.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

from llmgw import messages as m
from llmgw.fleet.state import FleetState

# XIDs after which a GPU's node is taken out of placement until an operator looks (NVIDIA's "reset or
# reboot" class): 48 double-bit ECC, 79 fallen off the bus, 94/95 contained/uncontained ECC.
FATAL_XIDS = (48, 79, 94, 95)
_XID = re.compile(r"xid (\d+)\b")


def quarantines(state: FleetState, now: datetime) -> list[tuple[m.NodeCordoned, str]]:
    """A node that lost a GPU to a fatal XID is cordoned (by "quarantine"), once per fault, with the reason;
    an operator who uncordons it after the fault has looked, and it is not cordoned again for that fault."""
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
    return out


def _key(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()
