"""A real vLLM for tests: the vLLM CPU build, installed once per machine by scripts/vllm.sh."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "vllm.sh"
# The first install on a machine takes a few minutes, and a caller may wait on another's.
INSTALL_LIMIT_S = 20 * 60


@functools.cache
def vllm_binary() -> Path:
    """The ``vllm`` executable scripts/vllm.sh prints on its last line; a failed install fails, never skips.

    scripts/test.sh installs it before the suite and says where in LLMGW_VLLM.
    """
    given = os.environ.get("LLMGW_VLLM")
    if given and os.access(given, os.X_OK):
        return Path(given)
    try:
        res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=INSTALL_LIMIT_S)
    except subprocess.TimeoutExpired as e:
        said = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
        pytest.fail(f"{SCRIPT} did not finish within {INSTALL_LIMIT_S}s:\n{said.decode(errors='replace')}",
                    pytrace=False)
    lines = res.stdout.strip().splitlines()
    binary = Path(lines[-1]) if lines else None
    if res.returncode or binary is None or not os.access(binary, os.X_OK):
        pytest.fail(f"{SCRIPT} exited {res.returncode} without a vllm executable:\n{res.stdout}{res.stderr}",
                    pytrace=False)
    return binary
