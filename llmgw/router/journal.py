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

Why a journal rather than publishing each count at once: a publish per request is a
round trip to the bus per request, and a message per request on the usage stream; a
line appended to a local file costs a system call, and the bus still sees one map a tick.
"""

from __future__ import annotations

import logging
import os
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


class Journal:
    """One router's journal file: appended per count, cut once a tick, read once at start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._cuts: dict[int, int] = {}  # tick of a map built, not yet stored → where its marker begins
        self._failed = False

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

    def open(self) -> None:
        """Append from now on (after ``read``: what the last boot left is kept until a map carries it)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            self._fail(e)

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
