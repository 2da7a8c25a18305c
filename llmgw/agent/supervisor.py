"""Engine supervision on an agent: run the engines the scheduler placed on this node.

The supervisor follows the control stream from the start, so on start it
reconciles: every replica placed here and not stopped should run. Each
replica gets a free port and ``CUDA_VISIBLE_DEVICES`` set to its GPUs, is
health-checked (``/health``, then a one-token completion), and is reported
through the agent's outbox as ``starting`` → ``healthy`` (with its endpoint)
or ``failed`` (with the engine's last log lines). A crashed engine is
restarted with back-off; one that keeps crashing is reported failed and left
to the scheduler, which re-places it with its own back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.runs import CHECK_S, EngineConfig, EngineRun, MemoryProbe
from llmgw.agent.turns import StartTurns
from llmgw.bus import Bus, Outbox
from llmgw.engine.argv import (
    parse_version_output,
    version_argv,
)
from llmgw.engine.policy import spec_problem
from llmgw.engine.upstream import Timeouts, Upstream
from llmgw.fleet.files import FETCHING_DETAIL
from llmgw.fleet.fold import Checkpoint, Memories, fold_batch
from llmgw.proc import die_with, exited, kill_group

log = logging.getLogger(__name__)

# The engine supervisor folds the control stream for this node's placements: no memory beyond the state.
ENGINES_KEEP = Memories(history=False, demand=False, observed=False, pool=False, lost=False)
ENGINES = ("vllm", "llama.cpp")  # the engines whose versions a node reports
# What an agent's control reader may have on the way: at 300 simulated agents on one connection, 8 MB
# each (the readers' default) would pass nats-server's 64 MB slow-consumer limit many times over.
AGENT_BYTES_IN_FLIGHT = 128 << 10


class VersionCache:
    """What each engine's ``--version`` said, by the command and its program's real path and mtime.

    vLLM answers in 10–25 s (it imports all of vLLM): an agent started again asks again only when
    the program changed (an upgrade rewrites it). A file that cannot be read or written costs a
    start its probe, nothing else.
    """

    KEEP = 32  # entries: a node's engines, and the programs they replaced

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._known: dict[str, str] = {}
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads(path.read_text())
                if isinstance(loaded, dict):
                    self._known = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, str)}

    @staticmethod
    def key(argv: list[str]) -> str | None:
        """The command and where its program is, as of now; None when it is not installed."""
        program = shutil.which(argv[0]) if argv else None
        if program is None:
            return None
        try:
            mtime = os.stat(program).st_mtime_ns
        except OSError:
            return None
        return json.dumps([os.path.realpath(program), mtime, argv[1:]])

    def get(self, argv: list[str]) -> str:
        key = self.key(argv)
        return self._known.get(key, "") if key is not None else ""

    def put(self, argv: list[str], version: str) -> None:
        key = self.key(argv)
        if key is None:
            return
        self._known.pop(key, None)
        self._known[key] = version  # the newest last: the oldest go first
        while len(self._known) > self.KEEP:
            del self._known[next(iter(self._known))]
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._known, indent=1))
            tmp.replace(self.path)
        except OSError as e:
            log.info("engine versions not kept in %s: %s; the next start asks the engines again", self.path, e)


class EngineSupervisor:
    """Keep this node's engines in line with the placements on the control stream."""

    def __init__(self, node: str, config: EngineConfig | None = None) -> None:
        self.node = node
        self.config = config or EngineConfig()
        # The fold of the control stream (no memories beyond it) and, from its hook, this node's share.
        self.checkpoint = Checkpoint()
        self.placed: dict[str, m.ReplicaPlaced] = {}
        self.runs: dict[str, EngineRun] = {}
        self.heads: dict[str, str] = {}  # replica → its head's address, for this node's worker parts
        # This node's fabric, as its agent knows it; a placement that names another is refused.
        self.fabric_of: Callable[[], str] | None = None
        self.refused: set[str] = set()
        self.stop_why: dict[str, str] = {}  # replica → why the control stream stopped it, for its stop report
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._reconciling = asyncio.Lock()
        self._placed_at: dict[str, int] = {}  # worker part → the sequence of its placement
        self._heads_changed = asyncio.Event()
        self.caught_up = asyncio.Event()
        self.memory_of: MemoryProbe | None = None  # set by the agent that runs this supervisor
        self.turns = StartTurns()  # engines sharing a GPU start one at a time
        # Set by the agent when it keeps the node's model files (llmgw.agent.downloads.FileKeeper.ready):
        # an engine starts only once its files are complete and verified here; a reason is why they are not.
        self.files_ready: Callable[[m.ModelSpec], Awaitable[str | None]] | None = None
        self.files_held: Callable[[m.ModelSpec], bool] | None = None  # whether they are here already
        # One HTTP client for every engine's health checks and readings (llmgw/engine/upstream.py, as the router's).
        # Each engine's API key, by the address this agent checks it at (``EngineRun.engine_keys``).
        self.engine_keys: dict[str, str] = {}
        self.http = Upstream(Timeouts(connect_s=5.0, read_s=CHECK_S), keys=self.engine_keys.get)
        self._versions = VersionCache(self.config.version_cache)

    def known_versions(self) -> dict[str, str]:
        """What the engines this node starts said they were, where their programs have not changed
        since (``VersionCache``): no process is started, so an inventory can carry them at once."""
        if self.config.simulate:
            return {}
        return {engine: v for engine in ENGINES if (v := self._versions.get(version_argv(engine, self.config.cmds)))}

    async def versions(self, timeout_s: float | None = None) -> dict[str, str]:
        """What the engines this node starts say they are (``vllm --version``, ``llama-server --version``),
        asked side by side, or known from before; an engine not installed, or silent within ``timeout_s``
        (the config's ``version_timeout_s``), is left out. Simulated engines have none."""
        if self.config.simulate:
            return {}
        limit = self.config.version_timeout_s if timeout_s is None else timeout_s
        found = await asyncio.gather(*(self._version(engine, limit) for engine in ENGINES))
        return {engine: v for engine, v in zip(ENGINES, found, strict=True) if v}

    async def _version(self, engine: str, timeout_s: float) -> str:
        argv = version_argv(engine, self.config.cmds)
        if known := self._versions.get(argv):
            return known
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with(os.getpid()))
        except OSError:
            return ""  # not installed here
        try:
            async with asyncio.timeout(timeout_s):
                text, _ = await proc.communicate()
        except TimeoutError:
            log.warning("`%s` did not answer within %gs: plans for %s are made for the fleet's other vLLM "
                        "versions, else the newest profile (ctl model plan --engine-version names one); the "
                        "agent's next start asks again", shlex.join(argv), timeout_s, self.node)
            return ""
        finally:
            kill_group(proc.pid)  # it, on a timeout or a cancel, and whatever it started
            await exited(proc)
        version = parse_version_output(text.decode(errors="replace"))
        if not version:
            last = text.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            log.warning("`%s` exited %s and printed no version (last: %s); plans for %s are made as if it had "
                        "not answered", shlex.join(argv), proc.returncode, last[0][:300], self.node)
            return ""
        self._versions.put(argv, version)
        return version

    def holds(self) -> list[tuple[int, tuple[int, ...], int]]:
        """(pid, (GPU index,), MiB there; 0: not known) of every engine process running here, for the
        simulated driver: what each booked on that GPU, or a real engine's last resident memory read
        (``--engines real`` on a simulated node), spread over its GPUs."""
        out: list[tuple[int, tuple[int, ...], int]] = []
        for run in self.runs.values():
            proc = run.proc
            if proc is None or proc.returncode is not None:
                continue
            booked = run.booked_per_gpu()
            rss = run.used_mib // len(booked) if self.config.cpu and run.used_mib and booked else 0
            out += [(proc.pid, (index,), rss or mib) for index, mib in booked]
        return out

    def _note(self, seq: int, event: m.Event, _moved: list[str] | None) -> None:
        """What this node's engines need of a control event the one fold took (``fold_batch``'s hook)."""
        match event:
            case m.ReplicaPlaced() if self.node in event.nodes:
                # Over several nodes, every node runs its part; the first node's is the head.
                self.placed[event.replica_id] = event
                if len(event.nodes) > 1 and event.nodes[0] != self.node:
                    self._placed_at[event.replica_id] = seq
                    self._heads_changed.set()
            case m.ReplicaStateChanged(replica_id=rid, node=node, head_address=address) if address:
                placed = self.placed.get(rid)
                if placed is not None and placed.nodes[0] == node and node != self.node:
                    self.heads[rid] = address  # where this node's part joins (only the head's own node says)
            case m.ReplicaStopped(replica_id=rid, reason=reason):
                if self.placed.pop(rid, None) is not None:
                    self.stop_why[rid] = reason
                if self.heads.pop(rid, None) is not None or self._placed_at.pop(rid, None) is not None:
                    self._heads_changed.set()
                self.refused.discard(rid)
            case m.ModelRemoved(name=name):
                for rid in [r for r, p in self.placed.items() if p.model == name]:
                    del self.placed[rid]
                    self.stop_why[rid] = f"model {name} removed"
                    if self._placed_at.pop(rid, None) is not None:
                        self._heads_changed.set()
            case _:
                pass

    async def _reconcile(self, outbox: Outbox) -> None:
        for rid in [r for r in self._tasks if r not in self.placed]:
            await self._end(rid)
            why = self.stop_why.pop(rid, "")
            self.runs.pop(rid).report("stopped", f"stopped: {why}" if why else "stopped on request")
        for rid in [r for r in self.stop_why if r not in self._tasks]:
            del self.stop_why[rid]  # never started here (refused, or waiting for its head)
        for rid, placed in self.placed.items():
            if rid in self.refused:
                continue
            fabric = self.fabric_of() if self.fabric_of is not None else ""
            if len(placed.nodes) > 1 and placed.fabric and fabric and placed.fabric != fabric:
                # A replica never spans fabrics: this node is not where the placement says.
                self.refused.add(rid)
                EngineRun(self.node, placed, self.config, outbox).report(
                    "failed", f"placed on fabric {placed.fabric}, but {self.node} is on {fabric}: a replica over "
                              "several nodes never spans fabrics; not started")
                continue
            refusal = spec_problem(placed.spec, self.config.policy, models_dir=self.config.models_dir,
                                   reads_files=not self.config.simulate)
            if refusal is not None:
                # The agent is the trust boundary: a `cli` login can declare any spec, and this node starts it.
                self.refused.add(rid)
                log.warning("replica %s refused on %s: %s", rid, self.node, refusal)
                EngineRun(self.node, placed, self.config, outbox).report("failed", f"{refusal}; not started")
                continue
            worker = placed.nodes[0] != self.node
            head = self.heads.get(rid, "")
            if worker and rid in self.runs and self.runs[rid].head_address != head:
                await self._end(rid)  # the head started again elsewhere: join it there
                del self.runs[rid]
            if rid not in self._tasks and (head or not worker):
                run = EngineRun(self.node, placed, self.config, outbox, head_address=head)
                run.memory_of, run.http, run.turns = self.memory_of, self.http, self.turns
                run.engine_keys = self.engine_keys
                self.runs[rid] = run
                self._tasks[rid] = asyncio.create_task(self._when_files_ready(run), name=f"engine-{rid}")

    async def _when_files_ready(self, run: EngineRun) -> None:
        """Fetch the replica's files first (agent work, not the engine's start-up), then run its engine."""
        if self.files_ready is not None:
            if self.files_held is None or not self.files_held(run.placed.spec):  # the ledger's download phase
                run.report("starting", f"{FETCHING_DETAIL}{run.placed.spec.source}")
            why = await self.files_ready(run.placed.spec)
            if why is not None:
                run.report("failed", why)
                return
        await run.run()

    async def _end(self, rid: str) -> None:
        task = self._tasks.pop(rid)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def run(self, bus: Bus, outbox: Outbox) -> None:
        """Follow the control stream; the agent runs this next to itself (``services=``).

        The server delivers only what an agent needs (``subjects.agent_control``); the heads'
        addresses of this node's multi-node parts come on a second, narrower reader (``_heads``).
        """
        target = await bus.stream_last_seq(subjects.STREAM_CONTROL)
        follower = bus.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, who=f"engines on {self.node}",
                              filter_subjects=subjects.agent_control(), max_bytes_in_flight=AGENT_BYTES_IN_FLIGHT)
        heads = asyncio.create_task(self._heads(bus, outbox), name=f"heads-{self.node}")
        try:
            if target == 0:
                self.caught_up.set()
            async for batch in follower.batches():
                # The one fold every reader folds by: a placement on another subject than its own,
                # or a head's address from a node its replica is not on, never starts anything here.
                why = fold_batch(self.checkpoint, subjects.STREAM_CONTROL, [d.raw for d in batch],
                                 [d.event for d in batch], keep=ENGINES_KEEP, before=self._note,
                                 subjects_checked=True)
                for d, refused in zip(batch, why, strict=True):
                    if refused is not None:
                        log.warning("control seq %d refused: %s", d.raw.seq, refused)
                # Reconcile only on what the whole history says, never on a prefix of it.
                if follower.last_seq >= target or follower.drained:
                    self.caught_up.set()
                if self.caught_up.is_set():
                    await self._reconciled(outbox)
        finally:
            tasks = [heads, *self._tasks.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.http.close()

    async def _reconciled(self, outbox: Outbox) -> None:
        async with self._reconciling:  # the control reader and the heads' reader both reconcile
            await self._reconcile(outbox)

    def _wanted_heads(self) -> dict[str, str]:
        """This node's worker parts: replica → its head's node."""
        return {rid: p.nodes[0] for rid, p in self.placed.items() if len(p.nodes) > 1 and p.nodes[0] != self.node}

    async def _heads(self, bus: Bus, outbox: Outbox) -> None:
        """Read the heads' state reports of this node's worker parts, from their placements on; read again
        whenever the set of parts changes (a multi-node placement is rare: this reader mostly sleeps)."""
        reading: dict[str, str] = {}
        reader: asyncio.Task[None] | None = None

        async def read(wanted: dict[str, str], start: int) -> None:
            follower = bus.follow(subjects.STREAM_CONTROL, m.CONTROL_DECODER, start, who=f"heads for {self.node}",
                                  filter_subjects=subjects.head_states(wanted),
                                  max_bytes_in_flight=AGENT_BYTES_IN_FLIGHT)
            async for batch in follower.batches():
                for d in batch:
                    self._note(d.raw.seq, d.event, None)  # its subject is the head's, checked by the follower
                if batch and self.caught_up.is_set():
                    await self._reconciled(outbox)

        try:
            while True:
                await self._heads_changed.wait()
                self._heads_changed.clear()
                wanted = self._wanted_heads()
                if wanted == reading:
                    continue
                if reader is not None:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
                    reader = None
                reading = wanted
                if wanted:
                    start = min(self._placed_at.get(rid, 1) for rid in wanted)
                    reader = asyncio.create_task(read(wanted, start), name=f"heads-read-{self.node}")
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def __call__(self, bus: Bus, outbox: Outbox) -> None:
        await self.run(bus, outbox)
