"""What ``ctl usage`` answers (issue 43 #6): anonymous traffic counted as the anonymous caller's, 429s and
403s apart from other errors, the analysts' copy's age, and live figures from the status service."""

from __future__ import annotations

from test_keys import ask, declared, until_status_model
from test_router import place

from llmgw.bus import Bus
from llmgw.engine.fake import spawn
from llmgw.messages.usage import ANONYMOUS_CALLER
from llmgw.router.server import Router


async def test_anonymous_requests_are_the_anonymous_callers_in_the_routers_map(bus: Bus) -> None:
    engine = spawn("k", name="A")
    router = Router(bus, "rt-anon", tick_s=3600)
    try:
        await place(bus, "A", "k", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("k")))
        assert [await ask(router, None, "k") for _ in range(2)] == [200, 200]
        use = (await router.publish_idle_map()).callers[ANONYMOUS_CALLER]["k"]
        assert use.requests == 2 and use.prompt_tokens > 0 and use.errors == 0
    finally:
        await router.stop()
        engine.stop()


async def test_429s_and_403s_are_counted_apart_from_other_errors(bus: Bus) -> None:
    engine = spawn("k", name="B")
    router = Router(bus, "rt-errs", tick_s=3600)
    try:
        await place(bus, "B", "k", engine.url)
        await router.start("127.0.0.1", 0)
        await router.sink.wait_for(lambda p: bool(p.healthy.get("k")))
        slow, slow_key = declared("slow", requests_per_minute=1)
        narrow, narrow_key = declared("narrow", models=("other",))
        await bus.publish(slow_key)
        await bus.publish(narrow_key)
        await until_status_model(router, slow, "k")  # its one request this minute
        assert await ask(router, slow, "k") == 429
        assert await ask(router, narrow, "k") == 403
        callers = (await router.publish_idle_map()).callers
        s, n = callers["slow"]["k"], callers["narrow"]["k"]
        assert (s.requests, s.errors, s.throttled, s.forbidden) == (2, 1, 1, 0)
        assert (n.requests, n.errors, n.throttled, n.forbidden) == (1, 1, 0, 1)
    finally:
        await router.stop()
        engine.stop()
