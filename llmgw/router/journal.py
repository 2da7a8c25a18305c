"""What a router's next idle map will carry, journaled as it is counted, so a crash loses no count.

A router publishes what each key asked (``callers``) once a tick; killed between two
ticks (SIGKILL, the OOM killer, a power cut of the process), it lost that tick's counts,
and a restarted router let a key have its minute again. Each count a request adds to
the next map (``KeyUseCounter``) is also one line appended here, with ``write(2)``
before the request's answer is finished: the kernel holds it whatever becomes of the
process (not of the machine: no fsync per request).

A map, when it is built, leaves a marker (its boot and tick) where it cut the journal;
once the bus has stored it, the journal is cut there (``published``): what is left is
only what no stored map carries. A router starting reads its own last stored map and
takes up every count after that map's marker (``uncovered``): into its quotas, as if
that map had been read, and into its next map, so the other routers and the usage
ledger count them too, once.

While no map is stored (the bus away) nothing cuts the journal: past ``COMPACT_BYTES`` a
failed tick folds it (``compact``) to a line per key, model and second of the last
``RECENT_S`` (what a minute's window needs) and one per key, model and UTC day before
(what a day's needs), so it grows with keys, not with requests.

Why a journal rather than publishing each count at once: a publish per request is a
round trip to the bus per request, and a message per request on the usage stream; a
line appended to a local file costs a system call, and the bus still sees one map a tick.
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)


class Counted(msgspec.Struct, tag="u", array_like=True, frozen=True):
    """What one request added to a key's use of a model, and when."""

    at: float
    key: str
    model: str
    requests: int = 0
    errors: int = 0
    throttled: int = 0
    forbidden: int = 0
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0


class Mapped(msgspec.Struct, tag="m", array_like=True, frozen=True):
    """A map was built here: what is above this line, it carries."""

    boot_id: str
    tick: int


Entry = Counted | Mapped
_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(Entry)
COMPACT_BYTES = 8 << 20  # a journal no stored map has cut past this is folded (``compact``)
RECENT_S = 120.0  # counts younger than this keep their second (a minute's window); older ones only their day


class Journal:
    """One router's journal file: appended per count, cut once a tick, read once at start."""

    def __init__(self, path: Path, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        self._fd = -1
        self._cuts: dict[int, int] = {}  # tick of a map built, not yet stored → where its marker begins
        self._failed = False
        self._compact_at = compact_bytes

    def read(self) -> list[Entry]:
        """What the journal holds (a line torn by a crash, or not ours, is skipped)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("quota journal %s cannot be read (%s); counts since the last map are lost", self.path,
                        e.strerror)
            return []
        out: list[Entry] = []
        for line in data.split(b"\n"):
            if line:
                try:
                    out.append(_DEC.decode(line))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        return out

    def open(self, kept: list[Entry] | None = None) -> None:
        """Append from now on; with ``kept``, the journal is first rewritten to hold only those (what the
        last boot left that no stored map carries, after that map's marker)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if kept is not None:
                self._rewrite(kept)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            self._fail(e)

    def _rewrite(self, entries: list[Entry]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(_ENC.encode(e) + b"\n" for e in entries))
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def write(self, entry: Entry) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, _ENC.encode(entry) + b"\n")
        except OSError as e:
            self._fail(e)

    def mapped(self, boot_id: str, tick: int) -> None:
        """A map is built now: mark where it cuts the journal."""
        if self._fd < 0:
            return
        try:
            self._cuts[tick] = os.fstat(self._fd).st_size
        except OSError as e:
            self._fail(e)
            return
        self.write(Mapped(boot_id, tick))

    def published(self, tick: int) -> None:
        """The bus stored map ``tick``: the journal keeps only its marker and what came after it."""
        at = self._cuts.pop(tick, None)
        if at is None or self._fd < 0:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(self.path, "rb") as f:
                f.seek(at)
                rest = f.read()
            with open(tmp, "wb") as f:
                f.write(rest)
            os.replace(tmp, self.path)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            self._fail(e)
            return
        os.close(self._fd)
        self._fd = fd
        self._cuts = {t: where - at for t, where in self._cuts.items() if t > tick}

    def compact(self, now: float | None = None) -> None:
        """A map was not stored: past ``compact_bytes`` (twice the last fold's size), fold what the journal
        holds after its first marker (the last map stored) per key, model and second, or day when older
        than ``RECENT_S``. Markers of maps on their way are dropped: a crash then counts by time instead."""
        if self._fd < 0:
            return
        try:
            if os.fstat(self._fd).st_size < self._compact_at:
                return
        except OSError as e:
            self._fail(e)
            return
        now = time.time() if now is None else now
        entries = self.read()
        head: list[Entry] = [entries[0]] if entries and isinstance(entries[0], Mapped) else []
        folded: dict[tuple[str, str, float | str], list[float]] = {}
        for c in entries:
            if not isinstance(c, Counted):
                continue
            when: float | str = (float(math.floor(c.at)) if c.at > now - RECENT_S
                                 else datetime.fromtimestamp(c.at, UTC).strftime("%Y-%m-%d"))
            f = folded.setdefault((c.key, c.model, when), [c.at, *([0.0] * 9)])
            f[0] = max(f[0], c.at)
            for i, v in enumerate((c.requests, c.errors, c.throttled, c.forbidden, c.prompt, c.completion,
                                   c.cached, c.ttft_s, c.latency_s), start=1):
                f[i] += v
        out = head + [Counted(f[0], key, model, requests=int(f[1]), errors=int(f[2]), throttled=int(f[3]),
                              forbidden=int(f[4]), prompt=int(f[5]), completion=int(f[6]), cached=int(f[7]),
                              ttft_s=f[8], latency_s=f[9])
                      for (key, model, _), f in sorted(folded.items(), key=lambda kv: kv[1][0])]
        try:
            self._rewrite(out)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            os.close(self._fd)
            self._fd = fd
            size = os.fstat(fd).st_size
        except OSError as e:
            self._fail(e)
            return
        self._cuts = {}
        self._compact_at = max(self.compact_bytes, 2 * size)
        log.info("quota journal %s folded from %d entries to %d while no map is stored", self.path, len(entries),
                 len(out))

    def _fail(self, e: OSError) -> None:
        if not self._failed:  # once: a full disk must not fill the log too
            log.warning("quota journal %s cannot be written (%s); a crash now loses the counts since the last map",
                        self.path, e.strerror or e)
        self._failed = True


def uncovered(entries: list[Entry], boot_id: str | None, tick: int, at: float) -> list[Counted]:
    """The counts no stored map carries, given this router's last stored map (``boot_id`` and ``tick``,
    None when the bus holds none of its maps).

    Its marker found: what came after it. A stored map the journal has no marker of (a journal
    that was not kept meanwhile): what was counted after that map's time ``at``.
    """
    if boot_id is None:
        return [e for e in entries if isinstance(e, Counted)]
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if isinstance(e, Mapped) and e.boot_id == boot_id and e.tick == tick:
            return [c for c in entries[i + 1:] if isinstance(c, Counted)]
    return [e for e in entries if isinstance(e, Counted) and e.at > at]
