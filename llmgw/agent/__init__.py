"""The node agent (``llmgw agent``): reports one node's GPUs and runs the engines placed on it.

* ``node.Agent`` reads the GPUs through an NVML port (``nvml.RealNvml`` over pynvml, or
  ``simnvml.SimNvml`` for a node of a fleet file), publishes the inventory, health
  changes and heartbeats, and answers fault injections on a simulated node.
* ``supervisor.EngineSupervisor`` folds the control stream for this node's placements
  and runs each replica's engine (``EngineRun``): starts it with the argv from
  ``llmgw.engine.argv``, checks its health, reads what it reserved, keeps its log.

**When an engine dies**: ``EngineRun.run`` wakes from ``_any_exit`` (an engine process
ended), ``stop``s its process groups (SIGTERM, SIGKILL after 10 s), reports the replica
``unhealthy`` with the exit status and the last lines of its log, and starts it again
after a back-off (2 s, doubling, at most 60 s); after ``max_restarts`` it reports
``failed`` and leaves the replica to the scheduler, which re-places it with its own
back-off. Engines die with their agent (``llmgw.proc``), so a restarted agent never
finds a second engine on its GPUs.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.agent.node import Agent
    from llmgw.agent.nvml import NvmlPort, RealNvml
    from llmgw.agent.simnvml import SimNvml
    from llmgw.agent.supervisor import EngineConfig, EngineSupervisor

_FACE = {
    "Agent": "llmgw.agent.node",
    "NvmlPort": "llmgw.agent.nvml",
    "RealNvml": "llmgw.agent.nvml",
    "SimNvml": "llmgw.agent.simnvml",
    "EngineConfig": "llmgw.agent.supervisor",
    "EngineSupervisor": "llmgw.agent.supervisor",
}
__all__ = ["Agent", "EngineConfig", "EngineSupervisor", "NvmlPort", "RealNvml", "SimNvml"]
__getattr__ = lazy_face(__name__, _FACE)
