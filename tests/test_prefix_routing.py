"""Prefix-aware routing: the key, the homes, the load bound, and the fake engine's cache through a router."""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from running import engines as running_engines
from test_router import now, set_state

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.engine.fake import EngineProcess, PrefixCache
from llmgw.router import prefix as pr
from llmgw.router.server import Router

CHAT = "/v1/chat/completions"


def chat(*messages: tuple[str, object]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def system_prompt(i: int, size: int = 3000) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "tool", "json", "answer"]) for _ in range(size // 5))


@dataclass
class Rep:
    replica_id: str
    outstanding: int = 0


# --- the key ------------------------------------------------------------------------


def test_prompts_that_begin_alike_share_a_key_and_others_do_not() -> None:
    a1 = pr.prompt_key(CHAT, chat(("system", system_prompt(1)), ("user", "what is 2+2?")))
    a2 = pr.prompt_key(CHAT, chat(("system", system_prompt(1)), ("user", "and 3+3?"), ("assistant", "6")))
    b = pr.prompt_key(CHAT, chat(("system", system_prompt(2)), ("user", "what is 2+2?")))
    assert a1 is not None and a1 == a2 and b is not None and b != a1
    # Text parts read as the text itself; a completion's prompt by its own text.
    parts = pr.prompt_key(CHAT, chat(("system", [{"type": "text", "text": system_prompt(1)}]), ("user", "x")))
    assert parts == a1
    c1 = pr.prompt_key("/v1/completions", json.dumps({"model": "m", "prompt": system_prompt(3) + " one"}).encode())
    c2 = pr.prompt_key("/v1/completions", json.dumps({"model": "m", "prompt": system_prompt(3) + " two"}).encode())
    assert c1 is not None and c1 == c2
    # Short prompts are hashed whole: two that differ are two keys.
    assert pr.prompt_key(CHAT, chat(("user", "hi"))) != pr.prompt_key(CHAT, chat(("user", "ho")))


@pytest.mark.parametrize(("what", "body"), [
    ("a 10 MB prompt", chat(("user", "x" * 10_000_000))),
    ("100,000 messages", chat(*[("user", "hello")] * 100_000)),
    ("non-string content parts", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [1, {"type": "image_url", "image_url": {"url": "x"}}, None, "s"]}]}).encode()),
    ("content that is a number", json.dumps({"model": "m", "messages": [{"role": "user", "content": 7}]}).encode()),
    ("a message that is not an object", json.dumps({"model": "m", "messages": ["hello", 3]}).encode()),
    ("a token-id prompt", json.dumps({"model": "m", "prompt": list(range(50_000))}).encode()),
])
def test_a_bad_or_huge_prompt_still_gets_a_key_in_bounded_time(what: str, body: bytes) -> None:
    route = "/v1/completions" if b'"prompt"' in body else CHAT
    t0 = time.perf_counter()
    key = pr.prompt_key(route, body)
    spent = time.perf_counter() - t0
    assert isinstance(key, int), what
    print(f"{what}: {spent * 1000:.1f} ms")  # shown with -s; a figure, not an assertion


@pytest.mark.parametrize("body", [b'{"model": "m", "messages": []}', b'{"model": "m"}', b"not json",
                                  b'{"model": "m", "messages": "text"}'])
def test_no_prompt_to_key_on_routes_by_load(body: bytes) -> None:
    assert pr.prompt_key(CHAT, body) is None
    assert pr.prompt_key("/v1/embeddings", b'{"model": "m", "input": "abc"}') is None


# --- homes ------------------------------------------------------------------------


def test_homes_are_balanced_by_prefix_count() -> None:
    ring = pr.Ring([f"r{i}" for i in range(3)])
    keys = [pr._hash64(system_prompt(i).encode()) for i in range(12)]
    per = Counter(pr.homes(keys, ring).values())
    assert sum(per.values()) == 12 and max(per.values()) <= math.ceil(pr.PREFIX_FACTOR * 12 / 3)


def test_two_routers_that_saw_the_same_prefixes_agree_whatever_the_order() -> None:
    reps = [Rep(f"r{i}") for i in range(4)]
    keys = [pr._hash64(system_prompt(i).encode()) for i in range(20)]
    a, b = pr.PrefixTable(), pr.PrefixTable()
    for order, table in ((keys + keys, a), (list(reversed(keys)) * 2, b)):
        for k in order:
            pr.pick(table, k, reps, now=0.0)
    chosen_a = [pr.pick(a, k, reps, now=1.0) for k in keys]
    chosen_b = [pr.pick(b, k, reps, now=1.0) for k in keys]
    assert [r.replica_id for r in chosen_a] == [r.replica_id for r in chosen_b]  # type: ignore[union-attr]


def test_a_replica_leaving_moves_about_its_share_and_flapping_moves_nothing_else() -> None:
    """Its own prefixes move, and a few others as the survivors' caps fill (bounded loads' price)."""
    ids = [f"r{i}" for i in range(4)]
    keys = [pr._hash64(system_prompt(i).encode()) for i in range(20)]
    before = pr.homes(keys, pr.Ring(ids))
    moved_others = 0
    for gone in ids:
        after = pr.homes(keys, pr.Ring([r for r in ids if r != gone]))
        assert all(after[k] != gone for k in keys) and Counter(after.values()).most_common(1)[0][1] <= 7
        moved_others += sum(1 for k in keys if before[k] != after[k] and before[k] != gone)
    share = len(keys) / len(ids)
    assert moved_others / len(ids) <= share / 2  # on average at most half its share again (here 0.75 of 5)
    assert pr.homes(keys, pr.Ring(ids)) == before  # back again: every prefix home again


def test_a_hot_prefix_spills_past_the_load_bound_and_a_retry_takes_the_next() -> None:
    reps = [Rep(f"r{i}") for i in range(3)]
    table = pr.PrefixTable()
    key = pr._hash64(b"hot")
    assert pr.pick(table, key, reps, now=0.0) is None  # seen once: by load
    home = pr.pick(table, key, reps, now=0.0)  # homed at its second sighting
    assert home is not None
    home.outstanding = 2  # 2 + 1 > ceil(1.25 × (2 + 1) / 3) = 2
    spill = pr.pick(table, key, reps, now=0.0)
    assert spill is not None and spill is not home and spill.outstanding == 0
    home.outstanding = 0
    assert pr.pick(table, key, reps, now=0.0) is home  # the bound released: home again
    retry = pr.pick(table, key, reps, exclude=home, now=0.0)
    assert retry is not None and retry is not home


def test_the_healthy_set_changing_in_place_is_seen_by_the_next_pick() -> None:
    """The pool edits its list of healthy replicas in place; the table's ring and replicas follow it."""
    reps = [Rep("r0"), Rep("r1")]
    table = pr.PrefixTable()
    keys = [pr._hash64(system_prompt(i).encode()) for i in range(20)]
    for k in keys:
        pr.pick(table, k, reps, now=0.0)
    assert {pr.pick(table, k, reps, now=0.0).replica_id for k in keys} == {"r0", "r1"}  # type: ignore[union-attr]
    gone = reps.pop(0)  # r0 leaves; r2 comes, in the same list object
    reps.append(Rep("r2"))
    picked = [pr.pick(table, k, reps, now=0.0) for k in keys]
    assert all(p is not None and p is not gone and p in reps for p in picked)
    assert {p.replica_id for p in picked if p is not None} == {"r1", "r2"}
    again = Rep("r1")  # r1 replaced by another object of the same id (and fields): that object is picked
    reps[0] = again
    assert any(pr.pick(table, k, reps, now=0.0) is again for k in keys)


def test_prompts_seen_once_have_no_home_and_are_routed_by_load() -> None:
    reps = [Rep("a", 3), Rep("b", 1), Rep("c", 2)]
    table = pr.PrefixTable()
    assert all(pr.pick(table, pr._hash64(str(i).encode()), reps, now=0.0) is None for i in range(50))
    assert not table.homed and len(table.seen) == 50


def test_keys_expire_and_tables_stay_bounded() -> None:
    table = pr.PrefixTable()
    for i in range(pr.MAX_SEEN + 10):  # one caller: its own bound
        table.note(i, 0.0)
    assert len(table.seen) == pr.MAX_SEEN_PER_CALLER
    for i in range(pr.MAX_SEEN + 10):  # many callers: the bound of all
        table.note(10**6 + i, 0.0, caller=f"k{i % 8}")
    assert len(table.seen) == pr.MAX_SEEN
    table.note(10**6 + pr.MAX_SEEN + 5, 1.0, caller="k5")  # seen twice: homed
    assert 10**6 + pr.MAX_SEEN + 5 in table.homed
    table.expire(pr.WINDOW_S + 0.5)
    assert not table.seen and list(table.homed) == [10**6 + pr.MAX_SEEN + 5]
    table.expire(pr.WINDOW_S + 1.0)
    assert not table.homed


def test_one_callers_prefix_flood_leaves_anothers_homes_routed_home() -> None:
    """Issue 45: 1,100 prompts each sent twice evicted every other tenant's homed prefixes."""
    reps = [Rep(f"r{i}") for i in range(4)]
    table = pr.PrefixTable()
    mine = [pr._hash64(system_prompt(i).encode()) for i in range(20)]
    for k in mine + mine:
        pr.pick(table, k, reps, now=0.0, caller="victim")
    for i in range(1100):
        flood = pr._hash64(f"flood {i}".encode())
        pr.pick(table, flood, reps, now=1.0, caller="flooder")
        pr.pick(table, flood, reps, now=1.0, caller="flooder")
    assert all(k in table.homed for k in mine)
    assert all(pr.pick(table, k, reps, now=2.0, caller="victim") is not None for k in mine)  # home, not by load
    assert len(table.homed) <= pr.MAX_HOMED and sum(1 for k in table.homed if k not in mine) == pr.MAX_HOMED_PER_CALLER
    # Floods from many callers at once fill the table; the largest gives way, the victim's 20 stay.
    for c in range(8):
        for i in range(300):
            flood = pr._hash64(f"flood {c} {i}".encode())
            for _ in range(2):
                pr.pick(table, flood, reps, now=3.0, caller=f"flooder{c}")
    assert len(table.homed) == pr.MAX_HOMED and all(k in table.homed for k in mine)


def test_homes_kept_as_keys_come_are_the_rule_applied_afresh() -> None:
    """A new home is put in place (deferred acceptance), not by placing every home again: same answer."""
    rng = random.Random(7)
    for replicas in (3, 8, 64):
        ring = pr.Ring([f"r{i}" for i in range(replicas)])
        kept = pr.Homes(ring)
        keys: list[int] = []
        for _ in range(600):
            keys.append(rng.getrandbits(64))
            kept.add(keys[-1])
        assert kept.at == pr.homes(keys, ring)
        assert kept.rebuilds < 60  # the cap changed O(log n) times, not once per key
        for k in keys[:400]:  # keys leave: ghosts, then the rule afresh over those left
            kept.remove(k)
        assert set(kept.at) >= set(keys[400:]) and max(Counter(kept.at.values()).values()) <= kept.cap
        live = list(keys[400:])
        for _ in range(2000):  # churn: every live key keeps a home, under the cap
            if rng.random() < 0.45:
                kept.remove(live.pop(rng.randrange(len(live))))
            else:
                live.append(rng.getrandbits(64))
                kept.add(live[-1])
            assert all(k in kept.at for k in live)
        assert max(Counter(kept.at.values()).values()) <= kept.cap


def test_the_fake_engines_cache_holds_a_prefix_per_slot() -> None:
    cache = PrefixCache(2)
    a, b, c = (system_prompt(i, 2000).encode() for i in range(3))
    assert cache.take(a) == 0 and cache.take(b) == 0
    assert cache.take(a + b"more") >= len(a) // 4 - 16  # a's blocks are still in its slot
    assert cache.take(c) == 0  # evicts b, the least recently used
    assert cache.take(b) == 0 and cache.take(c) > 0


# --- through a router, fake engines with a prefix cache ---------------------------


@pytest.fixture(scope="module")
def cached_engines() -> Iterator[dict[str, EngineProcess]]:
    """Three engines with two cache slots each: six prefixes fit only when each replica holds two."""
    args = ("m", "--cache-slots", "2", "--chunks", "1")
    with running_engines(E0=args, E1=args, E2=args) as procs:
        yield procs


@pytest.fixture
async def prefix_router(bus: Bus, cached_engines: dict[str, EngineProcess]) -> AsyncIterator[Router]:
    r = Router(bus, "router-prefix", tick_s=3600)
    await r.start("127.0.0.1", 0)
    try:
        yield r
    finally:
        await r.stop()


async def declare(bus: Bus, router: Router, model: str, routing: str, engines: dict[str, EngineProcess]) -> None:
    spec = m.ModelSpec(name=model, source="x", precision="bf16", engine="vllm", gpu_class="H100", context=4096,
                       routing=routing)  # type: ignore[arg-type]
    await bus.publish(m.ModelDeclared(at=now(), spec=spec))
    for name, proc in engines.items():
        rid = f"{model}-{name}"
        await bus.publish(m.ReplicaPlaced(at=now(), replica_id=rid, model=model, nodes=("n1",),
                                          gpus=(m.GpuRef(node="n1", index=0, uuid=f"GPU-{rid}"),), spec=spec))
        await set_state(bus, rid, model, "healthy", proc.url)
    await router.sink.wait_for(lambda p: len(p.healthy.get(model, [])) == len(engines))


async def cached_share(router: Router, model: str, rounds: int, warm: int = 2) -> float:
    """Six prefixes, one request at a time in a shuffled order: the share of prompt tokens the engines had
    cached, over the rounds after ``warm`` (every prefix seen twice, so homed)."""
    rng = random.Random(7)
    got = router.metrics.registry.get_sample_value
    before = (0.0, 0.0)
    async with aiohttp.ClientSession() as http:
        for n in range(rounds):
            if n == warm:
                before = (got("llmgw_router_prompt_tokens_cached_total", {"model": model}) or 0,
                          got("llmgw_router_prompt_tokens_total", {"model": model}) or 0)
            for i in rng.sample(range(6), 6):
                body = {"model": model, "messages": [{"role": "system", "content": system_prompt(i)},
                                                     {"role": "user", "content": "go"}]}
                async with http.post(router.url + CHAT, json=body) as resp:
                    assert resp.status == 200
    cached = (got("llmgw_router_prompt_tokens_cached_total", {"model": model}) or 0) - before[0]
    return cached / ((got("llmgw_router_prompt_tokens_total", {"model": model}) or 0) - before[1])


async def test_prefix_routing_hits_the_cache_where_least_outstanding_misses(
    bus: Bus, prefix_router: Router, cached_engines: dict[str, EngineProcess]
) -> None:
    await declare(bus, prefix_router, "by-load", "least-outstanding", cached_engines)
    by_load = await cached_share(prefix_router, "by-load", 6)
    await declare(bus, prefix_router, "by-prefix", "prefix", cached_engines)
    by_prefix = await cached_share(prefix_router, "by-prefix", 6)
    # By load, each replica sees any of the six prefixes with its two slots: it mostly misses. By
    # prefix, each replica serves two of them once they are homed: every later request hits.
    assert by_prefix >= 0.6 and by_prefix > by_load + 0.3, (by_prefix, by_load)


async def test_each_replicas_cached_share_travels_in_the_routers_map(
    bus: Bus, prefix_router: Router, cached_engines: dict[str, EngineProcess]
) -> None:
    """What the engines reported goes once into the next map, per replica; a map not published keeps it."""
    await declare(bus, prefix_router, "mapped", "prefix", cached_engines)
    share = await cached_share(prefix_router, "mapped", 3, warm=0)
    got = prefix_router.metrics.registry.get_sample_value
    prompt = got("llmgw_router_prompt_tokens_total", {"model": "mapped"})
    first = await prefix_router.publish_idle_map()
    uses = {rid: u for rid, u in first.cache_use.items() if u.model == "mapped"}
    assert set(uses) == {f"mapped-{n}" for n in cached_engines}
    assert sum(u.prompt_tokens for u in uses.values()) == prompt
    assert sum(u.cached_tokens for u in uses.values()) / prompt == pytest.approx(share)
    again = await prefix_router.publish_idle_map()
    assert not any(u.model == "mapped" for u in again.cache_use.values())  # taken once


async def test_a_requests_prefix_is_charged_to_its_key(bus: Bus, prefix_router: Router,
                                                      cached_engines: dict[str, EngineProcess]) -> None:
    """Through the router: a prompt's home belongs to the key that sent it, so another key's flood cannot take it."""
    from llmgw import ctl

    secrets = {}
    for name in ("alice", "bob"):
        secret, key_id, salt, digest = ctl.new_key_secret()
        secrets[name] = secret
        await bus.publish(m.KeyDeclared(at=m.utcnow(), name=name, lookup_id=key_id, salt=salt, digest=digest))
    await declare(bus, prefix_router, "m-keys", "prefix", cached_engines)
    await prefix_router.sink.wait_for(lambda p: len(prefix_router.sink.keys_by_id) >= 2)
    url = prefix_router.url + CHAT
    bodies = {name: json.dumps({"model": "m-keys", "messages": [{"role": "system", "content": system_prompt(i)},
                                                                 {"role": "user", "content": "hi"}]}).encode()
              for i, name in enumerate(secrets)}
    async with aiohttp.ClientSession() as http:
        for name, body in bodies.items():
            for _ in range(2):
                async with http.post(url, data=body, headers={"Authorization": f"Bearer {secrets[name]}",
                                                              "Content-Type": "application/json"}) as resp:
                    assert resp.status == 200, await resp.text()
    table = prefix_router.prefixes["m-keys"]
    owners = {table.homed.owner[k] for k in table.homed}
    assert owners == {"alice", "bob"} and pr.prompt_key(CHAT, bodies["alice"]) in table.homed.by["alice"]
