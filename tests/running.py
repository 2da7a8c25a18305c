"""Run our services inside a test, bounded, and always stop them."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from llmgw.agent.node import Agent
from llmgw.engine.fake import EngineProcess, spawn


async def until(cond: Callable[[], bool | Awaitable[bool]], what: str, limit_s: float = 10.0,
                every_s: float = 0.05) -> None:
    """Poll ``cond`` (plain or async) until it holds; fail naming ``what`` after ``limit_s``."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {limit_s:.0f}s waiting for {what}")
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    """An agent running as a task; a start that fails raises here, not as a timeout."""
    task = asyncio.create_task(agent.run())
    started = asyncio.create_task(agent.started.wait())
    await asyncio.wait([task, started], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    assert agent.started.is_set(), "agent did not start within 10s"
    try:
        yield agent
    finally:
        agent.stop()
        await asyncio.wait_for(task, timeout=15)


@contextlib.contextmanager
def engines(**specs: tuple[str, ...]) -> Iterator[dict[str, EngineProcess]]:
    """Fake engine processes by name (NAME=(model, extra args…)); all stopped at the end."""
    started: dict[str, EngineProcess] = {}
    try:
        for name, (model, *args) in specs.items():
            started[name] = spawn(model, *args, name=name)
        yield started
    finally:
        for proc in started.values():
            proc.stop()
