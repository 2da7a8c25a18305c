"""The node agent (``llmgw agent``): reports one node's GPUs and runs the engines placed on it.

* ``node.Agent`` reads the GPUs through an NVML port (``nvml.RealNvml`` over pynvml, or
  ``simnvml.SimNvml`` for a node of a fleet file), publishes the inventory, health
  changes and heartbeats, and answers fault injections on a simulated node.
* ``supervisor.EngineSupervisor`` folds the control stream for this node's placements,
  runs one ``runs.EngineRun`` per replica placed here, and asks the engines their versions;
  ``runs.EngineRun`` starts its engine with the argv from ``llmgw.engine.argv``, checks its
  health, reads what it reserved and keeps its log.
* ``downloads.FileKeeper`` reports the model files on the node's disk (``files`` scans the
  stores), fetches what prefetches and placements need before an engine starts, verifies
  every file's digest, and evicts the least recently used within the disk budget.

**When an engine dies**: ``EngineRun.run`` wakes from ``_any_exit``, which watches the
engine's process itself (a pidfd, never its pipes: vLLM's children hold those open after
their leader is gone); ``stop`` ends the engine's whole process group (SIGTERM while the
leader runs, then SIGKILL to the group however the leader ended) and waits until none of it
is left; only then is the replica reported ``unhealthy``, with how it ended (its exit
status, the signal, or vLLM's dead engine core) and the lines that say what failed, and the
engine is started again after a back-off (2 s, doubling, at most 60 s). After
``max_restarts`` it reports ``failed`` and leaves the replica to the scheduler, which
re-places it with its own back-off. Engines die with their agent (``llmgw.proc``), so a
restarted agent never finds a second engine on its GPUs.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.agent.downloads import FileKeeper, FilesConfig
    from llmgw.agent.node import Agent
    from llmgw.agent.nvml import NvmlPort, RealNvml
    from llmgw.agent.runs import EngineConfig
    from llmgw.agent.simnvml import SimNvml
    from llmgw.agent.supervisor import EngineSupervisor

_FACE = {
    "Agent": "llmgw.agent.node",
    "FileKeeper": "llmgw.agent.downloads",
    "FilesConfig": "llmgw.agent.downloads",
    "NvmlPort": "llmgw.agent.nvml",
    "RealNvml": "llmgw.agent.nvml",
    "SimNvml": "llmgw.agent.simnvml",
    "EngineConfig": "llmgw.agent.runs",
    "EngineSupervisor": "llmgw.agent.supervisor",
}
__all__ = ["Agent", "EngineConfig", "EngineSupervisor", "FileKeeper", "FilesConfig", "NvmlPort", "RealNvml", "SimNvml"]
__getattr__ = lazy_face(__name__, _FACE)
