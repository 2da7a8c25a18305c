"""Several streams read as one history: in windows of the server's stored time.

A reader that catches up on more than one stream one after another (or each as fast
as it comes) holds, at any point, a cut that no single moment had: control read to
this morning, usage still at last week. Whatever it writes on the way (a fold
snapshot, above all) then serves no moment in the past. ``windows`` yields the
streams' messages a window at a time: every message stored at or before the
window's end, from every stream, and none after it, so that a fold that takes each
window whole stands at a moment that existed after every one of them.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator, Mapping

from llmgw.bus.frames import RawMsg
from llmgw.bus.reader import StreamReader


async def windows(readers: Mapping[str, StreamReader]) -> AsyncIterator[list[tuple[str, list[RawMsg]]]]:
    """Each window: per stream (in the order of ``readers``), its messages stored up to the window's
    end, in stream order. A window ends at the earliest stored time any unfinished stream has read
    up to, so no stream can still bring a message stored before it."""
    buffered: dict[str, deque[RawMsg]] = {s: deque() for s in readers}
    finished: set[str] = set()
    async with contextlib.AsyncExitStack() as stack:
        batches = {s: await stack.enter_async_context(contextlib.aclosing(r.batches()))  # type: ignore[type-var]
                   for s, r in readers.items()}
        while True:
            for stream, it in batches.items():
                if stream not in finished and not buffered[stream]:
                    try:
                        buffered[stream].extend(await anext(it))
                    except StopAsyncIteration:
                        finished.add(stream)
            open_ = [s for s in readers if s not in finished]
            if not open_ and not any(buffered.values()):
                return
            end = min((buffered[s][-1].ts_ns for s in open_), default=None)
            window: list[tuple[str, list[RawMsg]]] = []
            for stream, queue in buffered.items():
                run: list[RawMsg] = []
                while queue and (end is None or queue[0].ts_ns <= end):
                    run.append(queue.popleft())
                if run:
                    window.append((stream, run))
            yield window
