"""llmgw: an event-sourced control plane for running LLMs on GPU fleets.

One package per process (``agent``, ``router``, ``planner``, ``scheduler``,
``dashboard``, ``whatif``, ``ctl``), the core every process shares (``messages``,
``subjects``, ``bus``, ``fleet``) and what an engine is (``engine``); docs/architecture.md
draws them. Each package's ``__init__`` names its public face in ``__all__``; the CLI
imports only those names.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__version__ = "0.1.0"


def lazy_face(package: str, face: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__``: each name of its face imported from its module when first used.

    A command pays only for the modules it uses (the agent's face holds NVML and the HTTP
    client, the planner's the NATS service): ``face`` maps each public name to its module.
    """

    def __getattr__(name: str) -> Any:
        module = face.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        found = importlib.import_module(module)
        value = found if module == f"{package}.{name}" else getattr(found, name)  # a module of the face, or a name in one
        setattr(sys.modules[package], name, value)  # asked once
        return value

    return __getattr__
