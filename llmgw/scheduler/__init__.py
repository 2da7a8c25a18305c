"""The scheduler (``llmgw scheduler``): what should run where, and nodes that went silent.

**Where a placement is decided**: ``placement.decide(state, memory, now)``, a pure
function of the folded fleet (``llmgw.fleet``): it returns the events to publish
(``ReplicaPlaced`` on free healthy GPUs of the model's class within one fabric,
``ReplicaStopped`` for what should no longer run, ``ModelUnplaceable`` with the reason,
``ModelAutoscaled`` from the routers' demand). ``service.SchedulerService`` is the
process around it: it folds the fleet, control and usage streams live, holds the lease
(one scheduler decides at a time) and publishes what ``decide`` returns.
``liveness.HeartbeatMonitor`` turns missed heartbeats into ``NodeLost`` and their return
into ``NodeReturned``.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.scheduler.liveness import HeartbeatMonitor
    from llmgw.scheduler.maintenance import Quarantine
    from llmgw.scheduler.placement import decide
    from llmgw.scheduler.service import SchedulerService

_FACE = {
    "HeartbeatMonitor": "llmgw.scheduler.liveness",
    "Quarantine": "llmgw.scheduler.maintenance",
    "decide": "llmgw.scheduler.placement",
    "SchedulerService": "llmgw.scheduler.service",
}
__all__ = ["HeartbeatMonitor", "Quarantine", "SchedulerService", "decide"]
__getattr__ = lazy_face(__name__, _FACE)
