"""Prefix-aware routing: send a prompt where its beginning is most likely already cached.

A prompt whose prefix is in an engine's KV cache skips most of its prefill, so the
router sends prompts that begin alike to the same replica, within two bounds:

* **The key** is the prompt's beginning as the engine will see it: a chat's
  messages in order, each role then its text (the order a chat template
  concatenates them in); a completion's prompt. Only the first ``KEY_BYTES`` of
  that rendering are hashed, so two prompts sharing their first ``KEY_BYTES``
  share a key. The key is read from the one pass the gateway makes over the body
  (``openai_api.Head``: the messages as raw slices) and decodes only the first bytes
  of each text it reads, so past that pass (6–20 ms for 27 MB here) a 10 MB
  prompt's key costs what a 1 KiB one's does. A prompt shorter than that is hashed
  whole: it is cheap to prefill, there is little to save.
* **Homes, balanced by prefix count.** A key seen twice within ``WINDOW_S`` is
  *homed*: every homed key of a model gets a replica by one deterministic rule
  over the set of homed keys (in hash order, each takes the first replica
  clockwise on a consistent-hash ring that holds fewer than ``ceil(PREFIX_FACTOR
  × keys / replicas)`` homes, that cap rounded up in steps of 1/8 past 8: ``cap_step``).
  A new home is put in place in a few ring steps, not by placing every home again
  (``Homes``: O(log n) amortized). A replica caches only as many prefixes as it has
  slots, so three prefixes landing on one replica would thrash it; the cap
  spreads them evenly (a looser cap, as CHWBL's 1.25 for load, let six prefixes
  land 3/3/0 on three replicas). The rule depends only on the set of keys and the ring, so
  routers that have seen the same hot prefixes agree without talking (and
  converge as each hot prefix reaches every router). A replica leaving moves its
  own homes, and a few others where a survivor's cap fills first (20 prefixes
  over 4 replicas: 0.75 others on average besides its 5; coming back, every home
  is as before).
* **Each caller's own.** Keys seen and homed are charged to the caller that brought
  them (its key's name; every anonymous caller is one), bounded per caller
  (``MAX_HOMED_PER_CALLER``) and in all (``MAX_HOMED``); past the bound in all, the
  caller holding the most gives up its oldest. One caller's flood of prompts evicts
  its own homes, never another's (issue 45: 1,100 prompts each sent twice evicted
  every other tenant's).
* **Bounded load** (consistent hashing with bounded loads, as KubeAI's CHWBL): a
  replica whose requests in flight from this router would pass ``ceil(LOAD_FACTOR
  × mean)`` (the mean counting the new one) is passed over for the next replica on
  the ring, so a hot prefix spills instead of queueing behind one engine.
* **A key seen once** (random prompts, a prefix's first request) is routed by
  least-outstanding's own rule: on prompts that never repeat the policy *is*
  least-outstanding (measured: a first version that took the least loaded
  replica first clockwise from the key was 4–13 % slower on random prompts).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

import msgspec

from llmgw.messages.usage import ANONYMOUS_CALLER
from llmgw.router.openai_api import HEAD, Head

KEY_BYTES = 1024  # the rendered prompt's beginning that is hashed (~250 tokens of English)
LOAD_FACTOR = 1.25  # CHWBL's c: a replica over c × the mean in-flight load is passed over
PREFIX_FACTOR = 1.0  # homed prefixes per replica: at most ceil(this × keys / replicas)
WINDOW_S = 600.0  # a key not seen for this long is forgotten (its home too)
MAX_HOMED = 1024  # homed keys per model, all callers together
MAX_HOMED_PER_CALLER = 256  # … and per caller (a key's name; every anonymous caller is one)
MAX_SEEN = 8192  # keys seen once per model
MAX_SEEN_PER_CALLER = 2048
VNODES = 64  # ring points per replica: arcs within a few percent of each other
POLICIES = ("prefix", "least-outstanding")


class Routable(Protocol):
    @property
    def replica_id(self) -> str: ...
    @property
    def outstanding(self) -> int: ...


R = TypeVar("R", bound=Routable)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# --- the key ------------------------------------------------------------------------


class _Message(msgspec.Struct):
    role: str = ""
    content: msgspec.Raw = msgspec.Raw(b"null")


class _Part(msgspec.Struct):
    type: str = ""
    text: msgspec.Raw = msgspec.Raw(b'""')


_MESSAGE = msgspec.json.Decoder(_Message)
_PARTS = msgspec.json.Decoder(list[msgspec.Raw])
_PART = msgspec.json.Decoder(_Part)
_TEXT = msgspec.json.Decoder(str)
# A message as clients write it, role then content, read from its first bytes only; any other
# shape is decoded as a message (that message read once more). A content the message repeats
# is read as its first here: the key is a hint, never what the engine is sent.
_PLAIN = re.compile(rb'\s*\{\s*"role"\s*:\s*"([^"\\]*)"\s*,\s*"content"\s*:\s*(?=")')
_TEXT_RAW = 6 * KEY_BYTES + 16  # JSON bytes enough for KEY_BYTES of text (``\u0041`` is six for one)


def _text_head(raw: memoryview) -> bytes:
    """The first ``KEY_BYTES`` of the JSON string ``raw`` begins with, decoded from its first bytes only."""
    chunk = bytes(raw[:_TEXT_RAW])
    i = 1
    while (q := chunk.find(b'"', i)) != -1:  # the string ends within the chunk: decoded whole
        j = q - 1
        while chunk[j] == 0x5C:  # a backslash
            j -= 1
        if (q - 1 - j) % 2 == 0:
            chunk = chunk[:q + 1]
            break
        i = q + 1
    else:
        chunk += b'"'
    for cut in range(16):  # an escape or a UTF-8 character cut in two: a byte less, up to a surrogate pair
        try:
            text = _TEXT.decode(chunk[:len(chunk) - 1 - cut] + b'"' if cut else chunk)
        except msgspec.DecodeError:
            continue
        return text.encode()[:KEY_BYTES]
    return bytes(raw[:KEY_BYTES])


def _content(raw: memoryview) -> bytes | None:
    """A message's content as the key reads it: its text, its parts' texts; None for null."""
    if raw[:1] == b'"':
        return _text_head(raw)
    if raw[:1] != b"[":
        return None if bytes(raw[:4]) == b"null" else bytes(raw[:KEY_BYTES])
    out = bytearray()
    for part_raw in _PARTS.decode(raw):
        try:
            part = _PART.decode(part_raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            out += memoryview(part_raw)[:KEY_BYTES]
        else:
            out += _text_head(memoryview(part.text)) if part.type == "text" else f"<{part.type}>".encode()
        if len(out) >= KEY_BYTES:
            break
    return bytes(out)


def _render_chat(messages: Sequence[msgspec.Raw]) -> bytes:
    """The messages' beginning as a chat template lays them out (role, then text), up to KEY_BYTES."""
    out = bytearray()
    for raw in messages:
        content: bytes | None
        view = memoryview(raw)
        plain = _PLAIN.match(view[:256])
        try:
            if plain is not None:
                role, content = plain.group(1), _text_head(view[plain.end():])
            else:
                msg = _MESSAGE.decode(raw)
                role, content = msg.role.encode(), _content(memoryview(msg.content))
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeEncodeError):
            out += view[:KEY_BYTES]  # not a message we can read: its bytes, as sent
        else:
            out += b"<|" + role + b"|>\n" + (content or b"") + b"\n"
        if len(out) >= KEY_BYTES:
            break
    return bytes(out[:KEY_BYTES])


def prompt_key(route: str, body: bytes | Head) -> int | None:
    """The routing key of a request (its body, or the head the gateway read of it), or None (no prompt to
    key on: route by load alone).

    Bounded: a ``messages`` list is read as raw slices of the body, only as many messages and
    parts as fill ``KEY_BYTES``, and of each text only its first bytes are decoded.
    """
    if isinstance(body, Head):
        head = body
    else:
        try:
            head = HEAD.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
    if route.endswith("/chat/completions"):
        if not isinstance(head.messages, list) or not head.messages:
            return None
        rendered = _render_chat(head.messages)
    elif route.endswith("/completions"):
        raw = memoryview(head.prompt)
        if not len(raw) or bytes(raw[:4]) == b"null":
            return None
        rendered = _text_head(raw) if raw[:1] == b'"' else bytes(raw[:KEY_BYTES])
    else:
        return None  # embeddings keep no KV cache between requests
    return _hash64(rendered) if rendered else None


# --- the ring and the homes ----------------------------------------------------------


class Ring:
    """A consistent-hash ring over replica ids: each replica owns ``VNODES`` points."""

    def __init__(self, replica_ids: Sequence[str]) -> None:
        points = sorted((_hash64(f"{rid}#{i}".encode()), rid) for rid in replica_ids for i in range(VNODES))
        self.hashes = [h for h, _ in points]
        self.owners = [rid for _, rid in points]
        self.size = len(set(replica_ids))

    def walk(self, key: int) -> Iterator[str]:
        """Every replica once, clockwise from ``key``; lazily, so the first costs a bisect."""
        n = len(self.hashes)
        if not n:
            return
        i = bisect_left(self.hashes, key)
        seen: set[str] = set()
        for j in range(n):
            rid = self.owners[(i + j) % n]
            if rid not in seen:
                seen.add(rid)
                yield rid
                if len(seen) == self.size:
                    return


def cap_step(n: int) -> int:
    """The prefix cap for ``n`` homes a replica: exact up to 8, then in steps of 1/8 (9, 11, 13, 15, 17, 20…).

    Stepped so that it changes O(log n) times as homes grow: each change re-places every
    home, and between changes a new home costs a few ring steps (``Homes.add``).
    """
    step = 8
    if n <= step:
        return max(1, n)
    while step < n:
        step = math.ceil(step * 1.125)
    return step


class Homes:
    """Each homed key's replica by one rule over the set of keys and the ring, kept as keys come and go.

    The rule: in hash order, each key takes the first replica clockwise with fewer than
    ``cap`` homes (``cap_step(ceil(PREFIX_FACTOR × keys / replicas))``). A new key is put
    in place as deferred acceptance does (it takes the first replica with room, or the
    place of a holder with a larger hash, which moves on clockwise): that ends where the
    rule applied to the new set ends, in a few ring steps rather than a pass over every
    home. A key that leaves keeps its place as a ghost, so that no other home moves, until
    a new key needs the place (a ghost gives way to any key) or ghosts pass half the
    places; then, and when the cap must grow, every home is placed afresh by the rule.
    Routers that saw the same keys agree; a new home costs O(log n) amortized.
    """

    def __init__(self, ring: Ring, keys: Sequence[int] = ()) -> None:
        self.ring = ring
        self.at: dict[int, str] = {}
        self._held: dict[str, list[int]] = {}  # per replica, its keys in hash order (ghosts too)
        self._ghosts: dict[str, set[int]] = {}  # per replica, the keys that left but keep their place
        self._ghost_count = 0
        self.cap = 0
        self.rebuilds = 0
        self.rebuild(keys)

    def _cap(self, n: int) -> int:
        return cap_step(math.ceil(PREFIX_FACTOR * n / self.ring.size)) if self.ring.size else 0

    def _live(self) -> list[int]:
        gone = set().union(*self._ghosts.values()) if self._ghost_count else set()
        return [k for k in self.at if k not in gone]

    def rebuild(self, keys: Sequence[int]) -> None:
        self.rebuilds += 1
        self.at, self._held, self._ghosts, self._ghost_count = {}, {}, {}, 0
        self.cap = self._cap(len(keys))
        for key in sorted(keys):  # in hash order nobody is displaced: the rule itself
            self._place(key)

    def add(self, key: int) -> None:
        rid = self.at.get(key)
        if rid is not None:
            ghosts = self._ghosts.get(rid)
            if ghosts is not None and key in ghosts:  # a ghost come back: its place is still its own
                ghosts.discard(key)
                self._ghost_count -= 1
            return
        if not self.ring.size:
            return
        if self._cap(len(self.at) - self._ghost_count + 1) > self.cap:
            self.rebuild([*self._live(), key])
            return
        self._place(key)

    def remove(self, key: int) -> None:
        rid = self.at.get(key)
        if rid is None or key in self._ghosts.get(rid, ()):
            return
        self._ghosts.setdefault(rid, set()).add(key)
        self._ghost_count += 1
        if self._ghost_count * 2 > len(self.at):
            self.rebuild(self._live())

    def _place(self, key: int) -> None:
        after: str | None = None  # a displaced key goes on from where it was displaced
        while True:
            walk = self.ring.walk(key)
            if after is not None:
                for rid in walk:
                    if rid == after:
                        break
            for rid in walk:
                held = self._held.setdefault(rid, [])
                if len(held) < self.cap:
                    insort(held, key)
                    self.at[key] = rid
                    return
                if ghosts := self._ghosts.get(rid):  # a ghost gives way, and is gone
                    ghost = ghosts.pop()
                    self._ghost_count -= 1
                    held.remove(ghost)
                    del self.at[ghost]
                    insort(held, key)
                    self.at[key] = rid
                    return
                if held[-1] > key:  # a holder later in hash order gives its place up and moves on
                    loser = held.pop()
                    insort(held, key)
                    self.at[key] = rid
                    del self.at[loser]
                    key, after = loser, rid
                    break
            else:
                if after is None:
                    return  # no room anywhere (cannot be: cap × replicas > keys, and ghosts give way)
                after = None  # the room a ghost left before where it was displaced: walk it all again


def homes(keys: Sequence[int], ring: Ring) -> dict[int, str]:
    """Each key's replica: in hash order, the first clockwise with room under the prefix cap."""
    return dict(Homes(ring, keys).at)


class Callers:
    """Keys in last-seen order, each charged to the caller (key name) that brought it; bounded per caller
    and in all. Past the bound in all, the caller holding the most gives up its oldest key: one
    caller's flood evicts its own keys, never another's."""

    def __init__(self, per_caller: int, total: int) -> None:
        self.per_caller, self.total = per_caller, total
        self.at: OrderedDict[int, float] = OrderedDict()  # last seen, oldest first
        self.owner: dict[int, str] = {}
        self.by: dict[str, OrderedDict[int, None]] = {}
        self._sizes: dict[int, set[str]] = {}  # callers by how many keys they hold
        self._max = 0

    def __contains__(self, key: object) -> bool:
        return key in self.at

    def __len__(self) -> int:
        return len(self.at)

    def __iter__(self) -> Iterator[int]:
        return iter(self.at)

    def _resize(self, caller: str, old: int, new: int) -> None:
        if old:
            group = self._sizes[old]
            group.discard(caller)
            if not group:
                del self._sizes[old]
                if old == self._max and new < old:
                    self._max = old - 1
        if new:
            self._sizes.setdefault(new, set()).add(caller)
            self._max = max(self._max, new)

    def touch(self, key: int, now: float) -> None:
        self.at[key] = now
        self.at.move_to_end(key)
        self.by[self.owner[key]].move_to_end(key)

    def add(self, key: int, caller: str, now: float) -> list[int]:
        """Remember ``key`` for ``caller``; the keys that made room for it."""
        evicted: list[int] = []
        mine = self.by.get(caller)
        if mine is not None and len(mine) >= self.per_caller:
            evicted.append(next(iter(mine)))
        elif len(self.at) >= self.total and self._max:
            largest = next(iter(self._sizes[self._max]))
            evicted.append(next(iter(self.by[largest])))
        for k in evicted:
            self.remove(k)
        mine = self.by.setdefault(caller, OrderedDict())
        mine[key] = None
        self.owner[key] = caller
        self.at[key] = now
        self._resize(caller, len(mine) - 1, len(mine))
        return evicted

    def remove(self, key: int) -> None:
        if self.at.pop(key, None) is None:
            return
        caller = self.owner.pop(key)
        mine = self.by[caller]
        del mine[key]
        self._resize(caller, len(mine) + 1, len(mine))
        if not mine:
            del self.by[caller]

    def expire(self, now: float) -> list[int]:
        """Forget keys not seen for ``WINDOW_S`` (oldest first); the keys forgotten."""
        gone: list[int] = []
        while self.at:
            key, at = next(iter(self.at.items()))
            if now - at < WINDOW_S:
                break
            self.remove(key)
            gone.append(key)
        return gone


class PrefixTable:
    """One model's keys: seen once, homed, and the homes over its healthy replicas."""

    def __init__(self) -> None:
        self.seen = Callers(MAX_SEEN_PER_CALLER, MAX_SEEN)
        self.homed = Callers(MAX_HOMED_PER_CALLER, MAX_HOMED)
        self._ring: Ring | None = None
        self._ring_of: tuple[str, ...] = ()
        self._homes: Homes | None = None
        self._members: tuple[Any, ...] = ()  # the healthy replicas the ring and ``_by_id`` were made of
        self._by_id: dict[str, Any] = {}
        self._members_ids: tuple[str, ...] = ()
        self._seen: tuple[int, ...] = ()

    def ring(self, replica_ids: tuple[str, ...]) -> Ring:
        if self._ring is None or replica_ids != self._ring_of:
            self._ring, self._ring_of, self._homes = Ring(replica_ids), replica_ids, None
        return self._ring

    def over(self, reps: Sequence[R]) -> tuple[Ring, dict[str, R]]:
        """The ring over ``reps`` and them by id, made again only when the healthy replicas change
        (the same objects, compared by identity: no sort, no dict per request)."""
        seen = tuple(map(id, reps))  # the objects' ids: ``_members`` holds them, so none is reused meanwhile
        if seen != self._seen or self._ring is None or self._ring_of != self._members_ids:
            self._members = tuple(reps)
            self._by_id = {r.replica_id: r for r in self._members}
            self._members_ids = tuple(sorted(self._by_id))
            self._seen = seen
        return self.ring(self._members_ids), self._by_id

    def home(self, key: int, ring: Ring) -> str | None:
        if key not in self.homed:
            return None
        if self._homes is None or self._homes.ring is not ring:
            self._homes = Homes(ring, list(self.homed))
        return self._homes.at.get(key)

    def _forget(self, keys: list[int]) -> None:
        if self._homes is not None:
            for k in keys:
                self._homes.remove(k)

    def note(self, key: int, now: float, caller: str = ANONYMOUS_CALLER) -> None:
        """A request with ``key`` from ``caller``: seen once, it is remembered; seen again, it is homed."""
        if key in self.homed:
            self.homed.touch(key, now)
            return
        if key in self.seen:
            self.seen.remove(key)
            self._forget(self.homed.add(key, caller, now))
            if self._homes is not None:
                self._homes.add(key)
            return
        self.seen.add(key, caller, now)

    def expire(self, now: float) -> None:
        """Forget keys not seen for ``WINDOW_S`` (oldest first: both are in last-seen order)."""
        self.seen.expire(now)
        self._forget(self.homed.expire(now))


def pick(table: PrefixTable, key: int, reps: Sequence[R], exclude: R | None = None,
         now: float | None = None, caller: str = ANONYMOUS_CALLER) -> R | None:
    """The replica for a request with ``key`` from ``caller`` among ``reps`` (the model's healthy ones),
    or None: no preference (a key not homed), route by load.

    A retry (``exclude``: the replica that failed) takes the next one clockwise and is
    not counted as another sighting of its key.
    """
    ring, everyone = table.over(reps)
    by_id = everyone if exclude is None else {rid: r for rid, r in everyone.items() if r is not exclude}
    if not by_id:
        return None
    if exclude is None:
        table.note(key, time.monotonic() if now is None else now, caller)  # homed at its second sighting
    home = table.home(key, ring)
    if home is None:  # seen once: no preference, the caller routes by load (least-outstanding's own rule)
        return None
    total = sum(r.outstanding for r in reps)
    # Rounded up, as CHWBL does. Measured both ways (docs/benchmarks.md): without the ceil, a second
    # request for a prefix already in flight spilled at once, both replicas then cached it, and the
    # shared-prefix hit rate fell from 85-89 % to 63-69 % with no TTFT gain left; with it, a hot
    # prefix's home may hold twice the mean when few requests are in flight.
    bound = math.ceil(LOAD_FACTOR * (total + 1) / len(reps))
    first = by_id.get(home)
    if first is not None and first.outstanding + 1 <= bound:
        return first  # the common case: no walk of the ring
    order = [by_id[rid] for rid in ring.walk(key) if rid in by_id]
    start = next((i for i, r in enumerate(order) if r.replica_id == home), 0)
    for r in order[start:] + order[:start]:
        if r.outstanding + 1 <= bound:
            return r
    return min(order, key=lambda r: r.outstanding)  # every one at the bound (cannot be, but never None)
