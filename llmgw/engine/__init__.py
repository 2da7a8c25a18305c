"""What the planner, the agent and the router all know of an engine (vLLM, llama.cpp, the fake one).

* ``argv``: an engine's command line, built once from a ``ModelSpec`` (what ``ctl model
  plan`` prints is what the agent runs), the Ray parts of a replica over nodes, and what
  an engine says it reserved (``/metrics``, ``/props``, ``--version``);
* ``profiles``: how each engine version counts the memory beside weights and KV cache;
* ``upstream``: the one outbound HTTP edge towards engines (the router's proxying, the
  agents' health checks);
* ``fake``: a small OpenAI-compatible engine for tests and benchmarks;
* ``fakeadapters``: its LoRA adapters, held as vLLM's or llama-server's are;
* ``policy``: what a declaration may make an agent start (the engine-argument allow-list, the model stores);
* ``demomodel``: a tiny random-weight model to plan and serve offline, and
  ``demolora`` a random LoRA adapter for it.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.engine import fake
    from llmgw.engine.argv import llmgw_program, parse_engine_cmds, shown_command, vllm_lora_rank
    from llmgw.engine.demolora import (
        check_demo_lora,
        demo_model_format,
        parse_lora_targets,
        write_demo_lora,
    )
    from llmgw.engine.demomodel import write_demo_model
    from llmgw.engine.policy import EnginePolicy, args_problem
    from llmgw.engine.upstream import Timeouts, Upstream

_FACE = {
    "fake": "llmgw.engine.fake",
    "llmgw_program": "llmgw.engine.argv",
    "parse_engine_cmds": "llmgw.engine.argv",
    "shown_command": "llmgw.engine.argv",
    "vllm_lora_rank": "llmgw.engine.argv",
    "check_demo_lora": "llmgw.engine.demolora",
    "demo_model_format": "llmgw.engine.demolora",
    "parse_lora_targets": "llmgw.engine.demolora",
    "write_demo_lora": "llmgw.engine.demolora",
    "write_demo_model": "llmgw.engine.demomodel",
    "EnginePolicy": "llmgw.engine.policy",
    "args_problem": "llmgw.engine.policy",
    "Timeouts": "llmgw.engine.upstream",
    "Upstream": "llmgw.engine.upstream",
}
__all__ = ["EnginePolicy", "Timeouts", "args_problem", "Upstream", "check_demo_lora", "demo_model_format", "fake", "llmgw_program", "parse_engine_cmds",
           "parse_lora_targets", "shown_command", "vllm_lora_rank", "write_demo_lora", "write_demo_model"]
__getattr__ = lazy_face(__name__, _FACE)
