"""A real vLLM for tests: the vLLM CPU build, installed once per machine by scripts/vllm.sh."""

from __future__ import annotations

import functools
from pathlib import Path

from llama import installed

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm.sh"
# The first install on a machine takes a few minutes, and a caller may wait on another's.
INSTALL_LIMIT_S = 20 * 60


@functools.cache
def vllm_binary() -> Path:
    """The ``vllm`` executable scripts/vllm.sh installs (LLMGW_VLLM)."""
    return installed(SCRIPT, "LLMGW_VLLM", INSTALL_LIMIT_S, "a vllm executable")
