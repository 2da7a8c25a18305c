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
from bisect import bisect_right
from collections import deque
from collections.abc import AsyncIterator, Mapping
from itertools import accumulate

from llmgw.bus.frames import RawMsg
from llmgw.bus.reader import StreamReader


async def windows(readers: Mapping[str, StreamReader], cut_ns: Mapping[str, int] | None = None,
                  ) -> AsyncIterator[list[tuple[str, list[RawMsg]]]]:
    """Each window: per stream (in the order of ``readers``), its messages stored up to the window's
    end, in stream order. A window ends at the earliest stored time any unfinished stream has read
    up to, so no stream can still bring a message stored before it.

    ``cut_ns`` (stream → stored time): a stream ends at its first message stored after that moment
    (a fold up to a moment), and is read no further.
    """
    cuts = cut_ns or {}
    # Each message with its stream's time so far: a server clock stepped back (NTP, a new R3
    # leader with another clock) must not hold a message back for ever behind a later one.
    buffered: dict[str, deque[tuple[int, RawMsg]]] = {s: deque() for s in readers}
    latest = dict.fromkeys(readers, 0)
    finished: set[str] = set()
    async with contextlib.AsyncExitStack() as stack:
        batches = {s: await stack.enter_async_context(contextlib.aclosing(r.batches()))  # type: ignore[type-var]
                   for s, r in readers.items()}
        while True:
            for stream, it in batches.items():
                if stream not in finished and not buffered[stream]:
                    try:
                        batch = await anext(it)
                    except StopAsyncIteration:
                        finished.add(stream)
                        continue
                    cut = cuts.get(stream)
                    for msg in batch:
                        if cut is not None and msg.ts_ns > cut:
                            finished.add(stream)  # past the moment: nothing more of this stream
                            await it.aclose()  # type: ignore[attr-defined]
                            break
                        latest[stream] = max(latest[stream], msg.ts_ns)
                        buffered[stream].append((latest[stream], msg))
            open_ = [s for s in readers if s not in finished]
            if not open_ and not any(buffered.values()):
                return
            end = min((buffered[s][-1][0] for s in open_), default=None)
            window: list[tuple[str, list[RawMsg]]] = []
            for stream, queue in buffered.items():
                run: list[RawMsg] = []
                while queue and (end is None or queue[0][0] <= end):
                    run.append(queue.popleft()[1])
                if run:
                    window.append((stream, run))
            # Never empty: the stream whose buffer ends at ``end`` drains whole (times only grow).
            yield window


Window = list[tuple[str, list[RawMsg]]]


def split_window(window: Window, n: int) -> tuple[Window, Window]:
    """``window`` cut at a stored time: the messages stored by the time the ``n``-th was (at least ``n`` of
    them, and every one stored by then from every stream, so itself a moment that existed), and the rest.

    The projector cuts a window where a fold snapshot falls due, so that one lands every so many events
    however large the windows a catch-up reads. Each stream's messages are cut by its time so far, as
    ``windows`` orders them.
    """
    if n >= sum(len(msgs) for _, msgs in window):
        return window, []
    so_far = [list(accumulate((x.ts_ns for x in msgs), max)) for _, msgs in window]
    times = sorted(t for ts in so_far for t in ts)
    end = times[max(n, 1) - 1]
    head: Window = []
    tail: Window = []
    for (stream, msgs), ts in zip(window, so_far, strict=True):
        k = bisect_right(ts, end)  # times so far only grow
        if k:
            head.append((stream, msgs[:k]))
        if k < len(msgs):
            tail.append((stream, msgs[k:]))
    return head, tail
