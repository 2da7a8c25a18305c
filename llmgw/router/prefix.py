"""Prefix-aware routing: send a prompt where its beginning is most likely already cached.

A prompt whose prefix is in an engine's KV cache skips most of its prefill, so the
router sends prompts that begin alike to the same replica, within two bounds:

* **The key** is the prompt's beginning as the engine will see it: a chat's
  messages in order, each role then its text (the order a chat template
  concatenates them in); a completion's prompt. Only the first ``KEY_BYTES`` of
  that rendering are hashed, so two prompts sharing their first ``KEY_BYTES``
  share a key, and a 10 MB prompt costs what a 1 KiB one does. A prompt shorter
  than that is hashed whole: it is cheap to prefill, there is little to save.
* **Homes, balanced by prefix count.** A key seen twice within ``WINDOW_S`` is
  *homed*: every homed key of a model gets a replica by one deterministic rule
  over the set of homed keys (in hash order, each takes the first replica
  clockwise on a consistent-hash ring that holds fewer than ``ceil(PREFIX_FACTOR
  × keys / replicas)`` homes). A replica caches only as many prefixes as it has
  slots, so three prefixes landing on one replica would thrash it; the cap
  spreads them evenly (a looser cap, as CHWBL's 1.25 for load, let six prefixes
  land 3/3/0 on three replicas). The rule depends only on the set of keys and the ring, so
  routers that have seen the same hot prefixes agree without talking (and
  converge as each hot prefix reaches every router). A replica leaving moves its
  own homes, and a few others where a survivor's cap fills first (20 prefixes
  over 4 replicas: 0.75 others on average besides its 5; coming back, every home
  is as before).
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
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

import msgspec

KEY_BYTES = 1024  # the rendered prompt's beginning that is hashed (~250 tokens of English)
LOAD_FACTOR = 1.25  # CHWBL's c: a replica over c × the mean in-flight load is passed over
PREFIX_FACTOR = 1.0  # homed prefixes per replica: at most ceil(this × keys / replicas)
WINDOW_S = 600.0  # a key not seen for this long is forgotten (its home too)
MAX_HOMED = 1024  # homed keys per model, newest kept
MAX_SEEN = 8192  # keys seen once per model, newest kept
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
    content: str | list[msgspec.Raw] | None = None


class _Part(msgspec.Struct):
    type: str = ""
    text: str = ""


class _Prompt(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"")  # (Raw | None would take only null)


_PROMPT = msgspec.json.Decoder(_Prompt)
_MESSAGE = msgspec.json.Decoder(_Message)
_PART = msgspec.json.Decoder(_Part)
_TEXT = msgspec.json.Decoder(str)


def _render_chat(messages: Sequence[msgspec.Raw]) -> bytes:
    """The messages' beginning as a chat template lays them out (role, then text), up to KEY_BYTES."""
    out = bytearray()
    for raw in messages:
        try:
            msg = _MESSAGE.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            out += bytes(raw)[:KEY_BYTES]  # not a message we can read: its bytes, as sent
        else:
            out += b"<|" + msg.role.encode() + b"|>\n"
            if isinstance(msg.content, str):
                out += msg.content.encode()[:KEY_BYTES]
            elif msg.content is not None:
                for part_raw in msg.content:
                    try:
                        part = _PART.decode(part_raw)
                        out += part.text.encode()[:KEY_BYTES] if part.type == "text" else f"<{part.type}>".encode()
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        out += bytes(part_raw)[:KEY_BYTES]
                    if len(out) >= KEY_BYTES:
                        break
            out += b"\n"
        if len(out) >= KEY_BYTES:
            break
    return bytes(out[:KEY_BYTES])


def prompt_key(route: str, body: bytes) -> int | None:
    """The routing key of a request body, or None (no prompt to key on: route by load alone).

    Bounded: a ``messages`` list is decoded as raw slices of the body, and only as many
    messages and parts are read as fill ``KEY_BYTES``.
    """
    try:
        prompt = _PROMPT.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if route.endswith("/chat/completions"):
        if not prompt.messages:
            return None
        rendered = _render_chat(prompt.messages)
    elif route.endswith("/completions"):
        raw = bytes(prompt.prompt)
        if not raw or raw == b"null":
            return None
        try:
            text = _TEXT.decode(raw) if raw[:1] == b'"' else None
        except msgspec.DecodeError:
            text = None
        rendered = text.encode()[:KEY_BYTES] if text is not None else raw[:KEY_BYTES]
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

    def walk(self, key: int) -> list[str]:
        """Every replica once, clockwise from ``key``."""
        out: list[str] = []
        n = len(self.hashes)
        if not n:
            return out
        i = bisect_left(self.hashes, key)
        seen: set[str] = set()
        for j in range(n):
            rid = self.owners[(i + j) % n]
            if rid not in seen:
                seen.add(rid)
                out.append(rid)
                if len(out) == self.size:
                    break
        return out


def homes(keys: Sequence[int], ring: Ring) -> dict[int, str]:
    """Each key's replica: in hash order, the first clockwise with room under the prefix cap."""
    if not ring.size:
        return {}
    cap = max(1, math.ceil(PREFIX_FACTOR * len(keys) / ring.size))
    count: dict[str, int] = {}
    out: dict[int, str] = {}
    for key in sorted(keys):
        for rid in ring.walk(key):
            if count.get(rid, 0) < cap:
                out[key] = rid
                count[rid] = count.get(rid, 0) + 1
                break
    return out


class PrefixTable:
    """One model's keys: seen once, homed, and the homes over its healthy replicas."""

    def __init__(self) -> None:
        self.seen: OrderedDict[int, float] = OrderedDict()
        self.homed: OrderedDict[int, float] = OrderedDict()
        self._ring: Ring | None = None
        self._ring_of: tuple[str, ...] = ()
        self._homes: dict[int, str] | None = None

    def ring(self, replica_ids: tuple[str, ...]) -> Ring:
        if self._ring is None or replica_ids != self._ring_of:
            self._ring, self._ring_of, self._homes = Ring(replica_ids), replica_ids, None
        return self._ring

    def home(self, key: int, ring: Ring) -> str | None:
        if key not in self.homed:
            return None
        if self._homes is None:
            self._homes = homes(list(self.homed), ring)
        return self._homes.get(key)

    def note(self, key: int, now: float) -> None:
        """A request with ``key``: seen once, it is remembered; seen again, it is homed."""
        if key in self.homed:
            self.homed[key] = now
            self.homed.move_to_end(key)
            return
        if self.seen.pop(key, None) is not None:
            self.homed[key] = now
            self._homes = None
            while len(self.homed) > MAX_HOMED:
                self.homed.popitem(last=False)
            return
        self.seen[key] = now
        while len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)

    def expire(self, now: float) -> None:
        """Forget keys not seen for ``WINDOW_S`` (oldest first: both are in last-seen order)."""
        for table in (self.seen, self.homed):
            while table:
                key, at = next(iter(table.items()))
                if now - at < WINDOW_S:
                    break
                del table[key]
                if table is self.homed:
                    self._homes = None


def pick(table: PrefixTable, key: int, reps: Sequence[R], exclude: R | None = None,
         now: float | None = None) -> R | None:
    """The replica for a request with ``key`` among ``reps`` (the model's healthy ones), or None: no
    preference (a key not homed), route by load.

    A retry (``exclude``: the replica that failed) takes the next one clockwise and is
    not counted as another sighting of its key.
    """
    by_id = {r.replica_id: r for r in reps if r is not exclude}
    if not by_id:
        return None
    ring = table.ring(tuple(sorted(r.replica_id for r in reps)))
    order = [by_id[rid] for rid in ring.walk(key) if rid in by_id]
    if exclude is None:
        table.note(key, time.monotonic() if now is None else now)  # homed at its second sighting
    home = table.home(key, ring)
    if home is None:  # seen once: no preference, the caller routes by load (least-outstanding's own rule)
        return None
    total = sum(r.outstanding for r in reps)
    # Rounded up, as CHWBL does. Measured both ways (docs/benchmarks.md): without the ceil, a second
    # request for a prefix already in flight spilled at once, both replicas then cached it, and the
    # shared-prefix hit rate fell from 85-89 % to 63-69 % with no TTFT gain left; with it, a hot
    # prefix's home may hold twice the mean when few requests are in flight.
    bound = math.ceil(LOAD_FACTOR * (total + 1) / len(reps))
    start = next((i for i, r in enumerate(order) if r.replica_id == home), 0)
    for r in order[start:] + order[:start]:
        if r.outstanding + 1 <= bound:
            return r
    return min(order, key=lambda r: r.outstanding)  # every one at the bound (cannot be, but never None)
