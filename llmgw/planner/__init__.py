"""The planner: will a model fit, and how to split it (``llmgw ctl model plan``, ``llmgw planner``).

* ``modelinfo`` reads a model, never retyped: its config.json and its parameter count
  from the checkpoint (a local directory, or the Hugging Face cache).
* **Where the KV arithmetic is**: ``memory``, the memory model, per GPU of one split:
  weights, the engine's overhead as its version's profile counts it
  (``llmgw.engine.profiles``), and the KV cache per token (layers × 2 × KV heads ×
  head_dim × dtype bytes; MLA, sliding-window and hybrid layers by their own rules).
* ``candidates.plan`` judges every split (precision, tp, pp, GPU class, fabric) against
  the fleet's cards and lists every candidate, fitting or not, with its reason and the
  engine command the agent would run.
* ``service.PlannerService`` answers plan requests over NATS from its own fold of the
  fleet and control streams.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.planner.candidates import plan, plan_name
    from llmgw.planner.modelinfo import load, parse_params
    from llmgw.planner.service import PlannerService

_FACE = {
    "plan": "llmgw.planner.candidates",
    "plan_name": "llmgw.planner.candidates",
    "load": "llmgw.planner.modelinfo",
    "parse_params": "llmgw.planner.modelinfo",
    "PlannerService": "llmgw.planner.service",
}
__all__ = ["PlannerService", "load", "parse_params", "plan", "plan_name"]
__getattr__ = lazy_face(__name__, _FACE)
