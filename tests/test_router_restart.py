"""A router that restarts takes up its last idle map: a replica idle for hours is not "idle 5s" after."""

from __future__ import annotations

import aiohttp
from test_router import in_pool, place

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.engine.fake import spawn
from llmgw.router.server import Router


async def first_map(bus: Bus, name: str) -> m.IdleMapPublished:
    """The first idle map a router of this name publishes once started (and stopped again)."""
    router = Router(bus, name, tick_s=3600)
    await router.start("127.0.0.1", 0)
    try:
        return await router.publish_idle_map()
    finally:
        await router.stop()


async def test_idle_time_survives_a_router_restart(bus: Bus) -> None:
    asked, quiet = spawn("keep", name="asked"), spawn("keep", name="quiet")
    try:
        await place(bus, "asked", "keep", asked.url)
        await place(bus, "quiet", "keep", quiet.url)
        first = Router(bus, "rt-restart", tick_s=3600)
        await first.start("127.0.0.1", 0)
        await first.sink.wait_for(in_pool("asked", "quiet"))
        first.pool.replicas["quiet"].pooled_at -= 3 * 3600  # as if it had served, unasked, for three hours
        async with aiohttp.ClientSession() as http:
            for i in range(20):  # prompts seen once go by load, ties rotating: until "asked" took one
                body = {"model": "keep", "messages": [{"role": "user", "content": f"hi {i}"}]}
                async with http.post(first.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                if "asked" in first.idle.last:
                    break
        first.idle.last.pop("quiet", None)  # "quiet" is never asked
        first.idle.last["asked"] -= 2 * 3600  # and "asked" last asked two hours ago
        before = await first.publish_idle_map()
        await first.stop()  # its last map, as on SIGTERM

        after = await first_map(bus, "rt-restart")
        assert after.boot_id != before.boot_id
        assert after.last_request["asked"] == before.last_request["asked"]
        assert after.serving_since["quiet"] == before.serving_since["quiet"]
        assert "quiet" not in after.last_request
        # Another router's name knows nothing of them: unknown is not idle.
        fresh = await first_map(bus, "rt-other")
        assert "asked" not in fresh.last_request
        assert fresh.serving_since["quiet"] > before.serving_since["quiet"]
        assert isinstance(fresh, m.IdleMapPublished)
    finally:
        asked.stop()
        quiet.stop()
