"""The agent's file keeper: reports what the node holds, fetches what it is asked for, keeps the budget.

``FileKeeper`` runs beside the agent (``services=``). It scans the node's stores at start and
whenever they change (``llmgw.agent.files``) and publishes ``NodeFilesReported``; it follows the
control stream (the one fold) for this node's placements, the operators' prefetch requests and
pins. A download is agent work, never an engine's start-up: ``ready(spec)``, which the engine
supervisor awaits before it starts an engine, fetches a spec's files with ``huggingface_hub`` (one
GGUF into the models directory, or a checkpoint's safetensors and configs into the Hugging Face
cache), publishes its progress, checks every file's size and digest, deletes and fetches again a
file that disagrees, and answers only when all are verified. Room is made by deleting the least
recently used sources that no placed or pinned model needs (``plan_evictions``); when that is not
enough the download is refused with the figures, before a byte is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.files import (
    PARTIAL_SUFFIXES,
    Disk,
    digest_matches,
    disk_free,
    gguf_without_digest,
    keep_digest,
    report,
    scan_hf_cache,
    scan_models_dir,
    source_dir_name,
)
from llmgw.agent.supervisor import AGENT_BYTES_IN_FLIGHT
from llmgw.bus import Bus, Outbox
from llmgw.engine.argv import is_repo_id
from llmgw.errors import LlmgwError
from llmgw.fleet.files import gib, held_complete, wanted_file
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch

log = logging.getLogger(__name__)

KEEP = Memories(history=False, demand=False, observed=False, pool=False, lost=False)
DISK_MARGIN = 0.05  # the default budget: what the disk holds, less this share (and 10 GiB at least)
DISK_MARGIN_MIN = 10 << 30
# What a checkpoint for vLLM needs of a repository: its weights, configs and tokenizer, nothing else
# (other precisions' GGUFs, original/ copies in .pth, images).
CHECKPOINT_PATTERNS = ("*.safetensors", "*.json", "tokenizer*", "*.txt", "*.model", "*.tiktoken", "*.jinja")
STATE_FILE = ".llmgw-files.json"


class DiskFullError(LlmgwError):
    """A download does not fit in the node's budget, even with everything evictable evicted."""


class DigestMismatchError(LlmgwError):
    """A downloaded file's content is not what the hub says it is."""


@dataclass(frozen=True)
class Held:
    """A source on disk as the eviction plan sees it."""

    source: str
    store: str
    size: int
    last_used: datetime | None


def plan_evictions(held: Iterable[Held], needed: set[str], budget: int, want: int) -> list[Held]:
    """The least recently used sources to delete so that ``want`` more bytes fit in ``budget``;
    never one that ``needed`` names. Raises ``DiskFullError`` with the figures when even all of
    them would not make room. Pure: the property test drives it over random cycles."""
    held = list(held)
    used = sum(h.size for h in held)
    if used + want <= budget:
        return []
    floor = datetime.min.replace(tzinfo=None)
    evictable = sorted((h for h in held if h.source not in needed),
                       key=lambda h: (h.last_used.replace(tzinfo=None) if h.last_used else floor, h.source))
    out: list[Held] = []
    for h in evictable:
        out.append(h)
        used -= h.size
        if used + want <= budget:
            return out
    kept = sum(h.size for h in held if h.source in needed)
    raise DiskFullError(
        f"{gib(want)} to download does not fit: the budget is {gib(budget)} and {gib(kept)} of it is held by "
        f"models that are placed here or pinned ({', '.join(sorted(needed & {h.source for h in held})) or 'none'}); "
        "raise agent --cache-max-gib, unpin a model (ctl model unpin) or stop a replica on this node")


@dataclass
class FilesConfig:
    """Where a node keeps model files, and how much of its disk they may take."""

    models_dir: Path
    hf_cache: Path
    cache_max_bytes: int = 0  # 0: what the disk holds less DISK_MARGIN
    endpoint: str | None = None  # the hub; None: $HF_ENDPOINT, else huggingface.co
    rescan_s: float = 30.0
    progress_s: float = 2.0
    attempts: int = 3  # a file whose digest disagrees is fetched again, up to this many times in all

    def __post_init__(self) -> None:
        self.endpoint = self.endpoint or os.environ.get("HF_ENDPOINT") or None
        if self.cache_max_bytes <= 0:
            probe = self.models_dir
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            st = os.statvfs(probe)
            total = st.f_blocks * st.f_frsize
            self.cache_max_bytes = max(0, total - max(int(total * DISK_MARGIN), DISK_MARGIN_MIN))


@dataclass
class _Fetch:
    model: str
    source: str
    total: int = 0
    files: int = 0
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=m.utcnow)


class FileKeeper:
    """One node's model files: what it holds (reported), what it fetches, what it evicts."""

    def __init__(self, node: str, config: FilesConfig, *, boot_id: str = "") -> None:
        self.node, self.config, self.boot_id = node, config, boot_id or os.urandom(8).hex()
        self.checkpoint = Checkpoint()
        self.placed: dict[str, m.ReplicaPlaced] = {}  # replicas on this node, not stopped
        self.outbox: Outbox | None = None
        self.held: list[m.HeldSource] = []
        self.last: m.NodeFilesReported | None = None
        self.caught_up = asyncio.Event()
        self._seq = 0
        self._signature: tuple[object, ...] = ()
        self._locks: dict[str, asyncio.Lock] = {}
        self._fetching: dict[str, _Fetch] = {}
        self._prefetch: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._state = self._load_state()  # {"used": {source: iso}, "evicted": {source: iso}}

    # --- what is needed ---------------------------------------------------------------------------

    def needed(self) -> set[str]:
        """Sources no eviction may touch: of replicas placed here, of pinned models, being fetched."""
        state = self.checkpoint.state
        pinned = {mv.spec.source for name, mv in state.models.items() if name in state.pinned}
        return {p.spec.source for p in self.placed.values()} | pinned | set(self._fetching)

    def holds(self, spec: m.ModelSpec) -> bool:
        """Whether the spec's files are here, complete: as last scanned, and still on disk (someone may
        have deleted them since; an engine must never be started on a file that is gone)."""
        held = [h for h in self.held if h.source == spec.source and self._present(h)]
        return held_complete(held, spec)

    def _present(self, h: m.HeldSource) -> bool:
        if h.store == "models-dir":
            root = self.config.models_dir / source_dir_name(h.source)
        else:
            root = self.config.hf_cache / f"models--{h.source.replace('/', '--')}" / "snapshots" / h.revision
        return all((root / f.path).is_file() for f in h.files if f.complete)

    # --- the local record: when each source was last used, and evicted ---------------------------

    def _load_state(self) -> dict[str, dict[str, str]]:
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads((self.config.models_dir / STATE_FILE).read_text())
            if isinstance(loaded, dict):
                return {k: dict(v) for k, v in loaded.items() if isinstance(v, dict)}
        return {"used": {}, "evicted": {}}

    def _save_state(self) -> None:
        try:
            self.config.models_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.config.models_dir / f"{STATE_FILE}.tmp"
            tmp.write_text(json.dumps(self._state, indent=1))
            tmp.replace(self.config.models_dir / STATE_FILE)
        except OSError as e:
            log.info("%s: when model files were used is not kept (%s); eviction falls back to file times", self.node, e)

    def _used(self) -> dict[str, datetime]:
        out = {}
        for source, iso in self._state.setdefault("used", {}).items():
            with contextlib.suppress(ValueError):
                out[source] = datetime.fromisoformat(iso)
        return out

    def touch(self, source: str) -> None:
        self._state.setdefault("used", {})[source] = m.utcnow().isoformat()
        self._save_state()

    # --- scanning and reporting -------------------------------------------------------------------

    def _scan(self) -> list[m.HeldSource]:
        used = self._used()
        return [*scan_models_dir(self.config.models_dir, used), *scan_hf_cache(self.config.hf_cache, used)]

    def _store_signature(self) -> tuple[object, ...]:
        """What changes when a store's files do: every file's path, size and mtime, cheaply."""
        out: list[object] = []
        for root in (self.config.models_dir, self.config.hf_cache):
            if root.is_dir():
                for dirpath, _, names in os.walk(root):
                    for n in names:
                        if n.endswith(PARTIAL_SUFFIXES):  # a download growing is progress, not a new report
                            out.append((dirpath, n, -1, -1))
                            continue
                        with contextlib.suppress(OSError):
                            st = os.stat(os.path.join(dirpath, n))
                            out.append((dirpath, n, st.st_size, st.st_mtime_ns))
        return tuple(sorted(out))  # type: ignore[type-var]

    async def rescan(self, *, force: bool = False) -> m.NodeFilesReported | None:
        """Scan the stores; publish a report when they changed (or ``force``). The report, or None."""
        signature = await asyncio.to_thread(self._store_signature)
        if not force and signature == self._signature and self.last is not None:
            return None
        self._signature = signature
        self.held = await asyncio.to_thread(self._scan)
        disk = Disk(budget=self.config.cache_max_bytes, free=disk_free(self.config.models_dir, self.config.hf_cache))
        event = report(self.node, self.boot_id, self.held, disk, m.utcnow())
        self._put(event)
        self.last = event
        return event

    async def _digests(self) -> None:
        """The sha256 of every GGUF not yet kept beside it (once per file), then a fresh report."""
        todo = await asyncio.to_thread(gguf_without_digest, self.config.models_dir)
        for path in todo:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(keep_digest, path)
        if todo:
            await self.rescan()

    def _put(self, event: m.Event) -> None:
        if self.outbox is None:
            return
        self._seq += 1
        self.outbox.put(event, msg_id=f"{type(event).__name__}:{self.node}:{self.boot_id}:{self._seq}")

    # --- the control stream -----------------------------------------------------------------------

    def _note(self, seq: int, event: m.Event, _moved: list[str] | None) -> None:
        match event:
            case m.ReplicaPlaced() if self.node in event.nodes:
                self.placed[event.replica_id] = event
            case m.ReplicaStopped(replica_id=rid):
                self.placed.pop(rid, None)
            case m.ModelRemoved(name=name):
                for rid in [r for r, p in self.placed.items() if p.model == name]:
                    del self.placed[rid]
            case m.ModelPrefetchRequested() if not event.nodes or self.node in event.nodes:
                model = self.checkpoint.state.models.get(event.name)
                evicted = self._state.get("evicted", {}).get(model.spec.source, "") if model else ""
                if self.caught_up.is_set() or not evicted or evicted < event.at.isoformat():
                    self._prefetch.put_nowait((event.name, event.revision))
            case _:
                pass

    async def _follow(self, bus: Bus) -> None:
        target = await bus.stream_last_seq(subjects.STREAM_CONTROL)
        follower = bus.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, who=f"files on {self.node}",
                              filter_subjects=subjects.agent_control(), max_bytes_in_flight=AGENT_BYTES_IN_FLIGHT)
        if target == 0:
            self.caught_up.set()
        async for batch in follower.batches():
            fold_batch(self.checkpoint, subjects.STREAM_CONTROL, [d.raw for d in batch], [d.event for d in batch],
                       keep=KEEP, before=self._note, subjects_checked=True)
            if follower.last_seq >= target or follower.drained:
                self.caught_up.set()

    async def _prefetcher(self) -> None:
        while True:
            name, revision = await self._prefetch.get()
            model = self.checkpoint.state.models.get(name)
            if model is None:
                log.warning("%s: prefetch of %s, which is not declared: nothing to fetch", self.node, name)
                continue
            reason = await self.ready(model.spec, revision=revision, use=False)
            if reason:
                log.warning("%s: prefetch of %s: %s", self.node, name, reason)

    async def _rescanner(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.rescan_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.rescan()
                await self._digests()
            except OSError as e:
                log.warning("%s: model files not scanned: %s", self.node, e)

    async def run(self, bus: Bus, outbox: Outbox) -> None:
        """Report, then follow the control stream, fetch and rescan until cancelled (``services=``)."""
        self.outbox = outbox
        await self.rescan(force=True)
        tasks = [asyncio.create_task(self._follow(bus), name="files-control"),
                 asyncio.create_task(self._prefetcher(), name="files-prefetch"),
                 asyncio.create_task(self._rescanner(), name="files-rescan"),
                 asyncio.create_task(self._digests(), name="files-digests")]
        try:
            done, _ = await asyncio.wait(tasks[:3], return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __call__(self, bus: Bus, outbox: Outbox) -> None:
        await self.run(bus, outbox)

    # --- fetching ---------------------------------------------------------------------------------

    async def ready(self, spec: m.ModelSpec, *, revision: str = "", use: bool = True) -> str | None:
        """Make a spec's files complete and verified on this node; None when they are, else why not.
        The engine supervisor awaits this before it starts an engine (``use``: it counts as a use)."""
        if not is_repo_id(spec.source) or (spec.file and Path(spec.file).is_absolute()):
            return None  # a path on the node: there is nothing to fetch, the engine reads it as it is
        if not self.held and self.last is None:
            self.held = await asyncio.to_thread(self._scan)
        lock = self._locks.setdefault(spec.source + "\0" + (wanted_file(spec) or ""), asyncio.Lock())
        async with lock:
            if self.holds(spec):
                if use:
                    self.touch(spec.source)
                return None
            fetch = _Fetch(model=spec.name, source=spec.source)
            self._fetching[spec.source] = fetch
            try:
                return await self._download(spec, revision, fetch, use)
            finally:
                self._fetching.pop(spec.source, None)

    async def _download(self, spec: m.ModelSpec, revision: str, fetch: _Fetch, use: bool) -> str | None:
        mismatches = 0
        try:
            plan = await asyncio.to_thread(self._remote_files, spec, revision)
            fetch.total, fetch.files = sum(size for _, size, _ in plan), len(plan)
            await self._make_room(spec.source, fetch.total - self._on_disk(spec))
            for attempt in range(self.config.attempts):
                progress = asyncio.create_task(self._progress(spec, fetch))
                try:
                    bad = await asyncio.to_thread(self._fetch_and_verify, spec, revision, plan)
                finally:
                    progress.cancel()
                    await asyncio.gather(progress, return_exceptions=True)
                if not bad:
                    break
                mismatches += len(bad)
                log.warning("%s: %s: %s did not match the hub's digest (attempt %d); deleted and fetched again",
                            self.node, spec.source, ", ".join(bad), attempt + 1)
            else:
                raise DigestMismatchError(f"{', '.join(bad)} of {spec.source} did not match the hub's digest "
                                          f"{self.config.attempts} times; not served")
        except DiskFullError as e:
            return self._finished(spec, fetch, ok=False, code="disk-full", reason=str(e), mismatches=mismatches)
        except DigestMismatchError as e:
            return self._finished(spec, fetch, ok=False, code="mismatch", reason=str(e), mismatches=mismatches)
        except Exception as e:  # noqa: BLE001 - the hub's and the disk's errors all end the download, said
            code = "not-found" if type(e).__name__ in ("EntryNotFoundError", "RepositoryNotFoundError",
                                                       "RevisionNotFoundError") else "error"
            return self._finished(spec, fetch, ok=False, code=code,
                                  reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:2000],
                                  mismatches=mismatches)
        if use:
            self.touch(spec.source)
        await self.rescan(force=True)
        self._finished(spec, fetch, ok=True, code="verified", reason="", mismatches=mismatches)
        return None

    def _finished(self, spec: m.ModelSpec, fetch: _Fetch, *, ok: bool, code: str, reason: str,
                  mismatches: int) -> str | None:
        self._put(m.DownloadFinished(at=m.utcnow(), node=self.node, model=spec.name, source=spec.source, ok=ok,
                                     size=fetch.total, files=fetch.files, seconds=round(time.monotonic() - fetch.started, 3),
                                     mismatches=mismatches, reason=reason, code=code, started_at=fetch.started_at))
        self._wake.set()
        return None if ok else f"files of {spec.source} not fetched ({code}): {reason}"

    def _hub(self) -> object:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.config.endpoint)

    def _remote_files(self, spec: m.ModelSpec, revision: str) -> list[tuple[str, int, str]]:
        """(path, size, digest) of each file the spec needs, as the hub lists them."""
        from huggingface_hub import RepoFile

        api = self._hub()
        entries = [f for f in api.list_repo_tree(spec.source, recursive=True, revision=revision or None)  # type: ignore[attr-defined]
                   if isinstance(f, RepoFile)]
        file = wanted_file(spec)
        if file is not None:
            chosen = [f for f in entries if f.path == spec.file or Path(f.path).name == file]
            if not chosen:
                raise FileNotFoundError(f"{spec.source} has no file {spec.file}")
        else:
            patterns = CHECKPOINT_PATTERNS if any(f.path.endswith(".safetensors") for f in entries) else (
                *CHECKPOINT_PATTERNS, "*.bin")
            chosen = [f for f in entries if any(fnmatch.fnmatch(Path(f.path).name, p) for p in patterns)]
        return [(f.path, f.lfs.size if f.lfs else f.size,
                 f"sha256:{f.lfs.sha256}" if f.lfs else f"git-sha1:{f.blob_id}") for f in chosen]

    def _target(self, spec: m.ModelSpec) -> Path:
        return self.config.models_dir / source_dir_name(spec.source)

    def _on_disk(self, spec: m.ModelSpec) -> int:
        """Bytes of the spec's source already here (a partial download counts: it is resumed)."""
        return sum(h.size for h in self.held if h.source == spec.source)

    def _fetch_and_verify(self, spec: m.ModelSpec, revision: str, plan: list[tuple[str, int, str]]) -> list[str]:
        """Fetch the planned files (resuming partial ones) and check each; the paths that disagreed, deleted."""
        from huggingface_hub import hf_hub_download

        bad = []
        for path, size, digest in plan:
            if wanted_file(spec) is not None:
                local = Path(hf_hub_download(spec.source, path, revision=revision or None,
                                             local_dir=self._target(spec), endpoint=self.config.endpoint))
            else:
                local = Path(hf_hub_download(spec.source, path, revision=revision or None,
                                             cache_dir=self.config.hf_cache, endpoint=self.config.endpoint))
            real = local.resolve()
            if real.stat().st_size != size or not digest_matches(real, digest):
                bad.append(path)
                real.unlink(missing_ok=True)
                local.unlink(missing_ok=True)
                meta = self._target(spec) / ".cache" / "huggingface" / "download" / f"{path}.metadata"
                meta.unlink(missing_ok=True)
                continue
            if real.suffix == ".gguf" and digest.startswith("sha256:"):
                keep_digest(real, digest.removeprefix("sha256:"))  # verified: kept beside it, not hashed again
        return bad

    def _bytes_fetched(self, spec: m.ModelSpec) -> int:
        roots = [self._target(spec)] if wanted_file(spec) is not None else [
            self.config.hf_cache / f"models--{spec.source.replace('/', '--')}" / "blobs"]
        total = 0
        for root in roots:
            if root.is_dir():
                for dirpath, _, names in os.walk(root):
                    for n in names:
                        if not n.endswith((".sha256", ".metadata", ".lock")):
                            with contextlib.suppress(OSError):
                                total += os.stat(os.path.join(dirpath, n)).st_size
        return total

    async def _progress(self, spec: m.ModelSpec, fetch: _Fetch) -> None:
        last_done, last_t = await asyncio.to_thread(self._bytes_fetched, spec), time.monotonic()
        while True:
            await asyncio.sleep(self.config.progress_s)
            done, now = await asyncio.to_thread(self._bytes_fetched, spec), time.monotonic()
            rate = max(0.0, (done - last_done) / (now - last_t)) if now > last_t else 0.0
            self._put(m.DownloadProgressed(at=m.utcnow(), node=self.node, model=spec.name, source=spec.source,
                                           done=min(done, fetch.total) if fetch.total else done, total=fetch.total,
                                           rate=round(rate, 1), started_at=fetch.started_at))
            last_done, last_t = done, now

    # --- the budget -------------------------------------------------------------------------------

    async def _make_room(self, source: str, want: int) -> None:
        if want <= 0:
            return
        held = [Held(h.source, h.store, h.size, h.last_used) for h in self.held]
        needed = self.needed() | {source}
        for h in plan_evictions(held, needed, self.config.cache_max_bytes, want):
            await asyncio.to_thread(self._delete, h)
            self._state.setdefault("evicted", {})[h.source] = m.utcnow().isoformat()
            self._save_state()
            self._put(m.FilesEvicted(at=m.utcnow(), node=self.node, source=h.source, store=h.store, size=h.size,
                                     last_used=h.last_used,
                                     reason=f"{gib(want)} of {source} to fetch within a {gib(self.config.cache_max_bytes)} budget"))
            log.info("%s: evicted %s (%s, last used %s)", self.node, h.source, gib(h.size), h.last_used)
        free = disk_free(self.config.models_dir, self.config.hf_cache)
        if free and want > free:
            raise DiskFullError(f"{gib(want)} to download, but the disk has {gib(free)} free (the budget allows "
                                f"{gib(self.config.cache_max_bytes)}); free the disk or lower agent --cache-max-gib")
        self.held = await asyncio.to_thread(self._scan)

    def _delete(self, h: Held) -> None:
        if h.store == "models-dir":
            shutil.rmtree(self.config.models_dir / source_dir_name(h.source), ignore_errors=True)
        else:
            shutil.rmtree(self.config.hf_cache / f"models--{h.source.replace('/', '--')}", ignore_errors=True)

