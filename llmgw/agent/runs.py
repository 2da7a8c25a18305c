"""One replica's engine on this node: its command, its process group, its health, its exit, its log.

``EngineRun`` starts the engine (the argv from ``llmgw.engine.argv``, a free port,
``CUDA_VISIBLE_DEVICES`` set to its GPUs), checks its health (``/health``, then a
one-token completion), reads what it reserved, reports ``starting`` → ``healthy`` (with
its endpoint) through the agent's outbox, sees its exit from the process (a pidfd, never
its pipes), ends its whole process group, and restarts it with back-off until
``EngineConfig.max_restarts``, then reports ``failed`` with what its output said failed.
Each start gives the engine a new API key (in its environment, never its command line), published
first for the routers alone (``EngineKeyIssued``): nothing reaches the engine around the router.

Over 600 lines: one engine's whole life (start, health, what it reserved and holds, exit, restart)
reads in one class; split, each half would carry the other's process and its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import signal
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import aiohttp

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.turns import StartTurns
from llmgw.bus import Outbox
from llmgw.engine.argv import (
    JOINED_MARKERS,
    api_key_env,
    default_commands,
    engine_argv,
    engine_env,
    exit_reason,
    failure_tail,
    fake_lora_load_ms,
    head_env,
    kv_tokens_from_metrics,
    kv_tokens_from_props,
    part_argvs,
)
from llmgw.engine.policy import EnginePolicy
from llmgw.engine.upstream import Timeouts, Upstream
from llmgw.proc import descendants, die_with, exited, group_members, kill_group, resident_mib

log = logging.getLogger(__name__)

CHECK_S = 10.0  # one health check or reading, all of it
STOP_S = 10.0  # a SIGTERMed engine's time to go before its group is SIGKILLed
# After SIGKILL: how long the group may take to be gone (a worker tearing down its CUDA context can
# take seconds), and how long its output may still drain; past either, the engine is reported anyway.
GONE_S = 10.0
DRAIN_S = 5.0


# Given the engine's processes and this node's GPU indexes, the MiB NVML lists for them (0: unknown).
MemoryProbe = Callable[[set[int], tuple[int, ...]], Awaitable[int]]
# A healthy engine's memory is reported again when it moved by more than this share or these MiB.
MEMORY_MOVED = 0.05
MEMORY_MOVED_MIB = 64


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def version_cache_path() -> Path | None:
    """``$XDG_CACHE_HOME/llmgw/engine-versions.json`` (``~/.cache`` by default); None without a home."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:
        return None
    return base / "llmgw" / "engine-versions.json"


@dataclass
class EngineConfig:
    """How this node runs engines."""

    cmds: dict[str, list[str]] = field(default_factory=default_commands)
    simulate: bool = False
    # The node's GPUs are simulated and its real engines run on the host's CPU (``--simulate
    # --engines real``): vLLM gets a CPU engine's arguments (``engine_argv(cpu=True)``).
    cpu: bool = False
    # Where engines listen and what the router dials. Empty: $LLMGW_ENGINE_HOST and
    # $LLMGW_ADVERTISE_HOST, else loopback in simulation and, on a real node,
    # every interface advertised under the host name (the router runs elsewhere).
    host: str = ""
    advertise_host: str = ""
    health_timeout_s: float = 900.0  # vLLM loading a 70B model takes minutes
    health_interval_s: float = 0.5
    # An engine that is up but answers the check 4xx (a model name it does not serve, a
    # request it refuses) will not change its mind while it loads: give up after this long.
    health_refused_s: float = 60.0
    max_restarts: int = 3
    backoff_base_s: float = 2.0
    backoff_max_s: float = 60.0
    log_lines: int = 20
    log_dir: Path | None = None
    # Each engine's log is rotated by size: <replica>.log, then .log.1 … .log.<log_keep>, the oldest dropped.
    log_max_bytes: int = 64 * 1024 * 1024
    log_keep: int = 3
    fake_startup_s: float = 0.0  # simulation: each fake engine's start-up time
    # Simulation: a fake vLLM's time to load a LoRA adapter (LLMGW_FAKE_LORA_LOAD_MS when unset).
    fake_lora_load_ms: float | None = None
    # Set for every engine process: NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, Ray's port range (--engine-env).
    env: dict[str, str] = field(default_factory=dict)
    # Org__Name model folders here (LLMGW_MODELS_DIR): a GGUF of a repository id found there is not downloaded.
    models_dir: Path | None = None
    # What a declaration may make it start (llmgw/engine/policy.py): engine arguments from the allow-list and
    # those its operator allows (--allow-engine-arg), model files inside its stores (None: anywhere).
    policy: EnginePolicy = field(default_factory=EnginePolicy)
    # What each engine's --version said, by its program's path and mtime (``VersionCache``); None: none kept.
    version_cache: Path | None = field(default_factory=lambda: version_cache_path())
    version_timeout_s: float = 60.0  # `vllm --version` imports all of vLLM: 10–25 s, more under load
    # How long an engine waits for another starting on one of its GPUs (``llmgw.agent.turns``);
    # 0: its health timeout, by which the one ahead is healthy or given up.
    share_wait_s: float = 0.0
    # How often a healthy engine's memory is read again; a change is reported only when material.
    memory_every_s: float = 30.0

    def __post_init__(self) -> None:
        env = os.environ
        self.host = self.host or env.get("LLMGW_ENGINE_HOST") or ("127.0.0.1" if self.simulate else "0.0.0.0")
        default_advertise = socket.gethostname() if self.host == "0.0.0.0" else self.host
        self.advertise_host = self.advertise_host or env.get("LLMGW_ADVERTISE_HOST") or default_advertise
        if self.models_dir is None and env.get("LLMGW_MODELS_DIR"):
            self.models_dir = Path(env["LLMGW_MODELS_DIR"])
        if self.fake_lora_load_ms is None:
            self.fake_lora_load_ms = fake_lora_load_ms(env.get("LLMGW_FAKE_LORA_LOAD_MS", "0"))

    @property
    def check_host(self) -> str:
        """Where the agent itself reaches an engine for health checks."""
        return "127.0.0.1" if self.host == "0.0.0.0" else self.host


class RotatingLog:
    """An engine's output file, rotated by size so that a chatty engine running for weeks cannot fill the
    disk: ``NAME`` grows to ``max_bytes``, then becomes ``NAME.1`` (``.1`` becomes ``.2`` …, the one past
    ``keep`` is dropped). Every line is in the file once written (unbuffered), for ``tail -F``. Several
    processes of one part (Ray and vLLM) each hold their own: a rename by one is seen by the other's
    next write, which reopens the new file."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path, self.max_bytes, self.keep = path, max(1, max_bytes), max(0, keep)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self._failing = False

    def write(self, line: bytes) -> None:
        """Append a line; a full or failing disk costs the file that line, never the engine its pipe
        (the pump keeps reading, so the engine never blocks on a full stdout)."""
        try:
            self._write(line)
            self._failing = False
        except OSError as e:
            if not self._failing:
                log.warning("engine log %s: %s; lines are dropped from the file until it can be written", self.path, e)
            self._failing = True

    def _write(self, line: bytes) -> None:
        if self._file.closed:
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
        mine = os.fstat(self._file.fileno())
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        if named is None or named.st_ino != mine.st_ino:  # another writer rotated it: write to the new file
            self._file.close()
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
            mine = os.fstat(self._file.fileno())
        if mine.st_size and mine.st_size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115

    def close(self) -> None:
        self._file.close()


KV_RETRIES, KV_RETRY_S = 15, 2.0  # the reservation asked again after an empty first read: ~30 s


class EngineRun:
    """One replica's engine on this node (or this node's part of it), and its restarts."""

    def __init__(self, node: str, placed: m.ReplicaPlaced, config: EngineConfig, outbox: Outbox,
                 head_address: str = "") -> None:
        self.node = node
        self.placed = placed
        self.config = config
        self.outbox = outbox
        # Over several nodes this node runs one part: the head (rank 0) serves, the others join it.
        self.rank = placed.nodes.index(node) if node in placed.nodes else 0
        self.multi = len(placed.nodes) > 1
        self.head_address = head_address  # a worker's: where it joins; the head's: what it publishes
        self.procs: list[asyncio.subprocess.Process] = []
        self._ended: set[int] = set()  # leaders whose whole group is gone (``stop``)
        self.port = 0
        self.restarts = 0
        self.state = "placed"
        self.endpoint = ""
        # Enough lines that what failed is among them (a traceback ends in shutdown chatter): the
        # report shows what failed first, then the last ``log_lines`` (``failure_tail``).
        self.tail: deque[str] = deque(maxlen=config.log_lines * 10)
        self.check_problem, self.check_refused = "", False  # the last health check: what went wrong, and whether 4xx
        self.memory_of: MemoryProbe | None = None  # the agent's NVML, when it runs this supervisor
        self.http: Upstream | None = None  # the supervisor's client; a run started alone makes its own
        # Engines' API keys by the address the agent checks them at: the supervisor's, shared with its client.
        self.engine_keys: dict[str, str] = {}
        self.api_key = ""  # this start's
        self._check_base = ""
        self.turns: StartTurns | None = None  # the node's start order for shared GPUs (the supervisor's)
        # What its engine holds here: last read, last reported (MiB), its KV figure, and over-bookings.
        self.used_mib, self._reported_mib, self._kv_tokens = 0, 0, 0
        self._asks_kv = False  # a worker part of a multi-node replica has no cache of its own to report
        self.overbooked, self.crossings = False, 0

    @property
    def replica_id(self) -> str:
        return self.placed.replica_id

    @property
    def proc(self) -> asyncio.subprocess.Process | None:
        """The process that serves (head or single engine), or this worker part's."""
        return self.procs[-1] if self.procs else None

    @property
    def gpu_indexes(self) -> tuple[int, ...]:
        """This node's GPUs of the replica."""
        return tuple(g.index for g in self.placed.gpus if g.node == self.node)

    def booked_per_gpu(self) -> list[tuple[int, int]]:
        """(GPU index, MiB booked there) for this node's GPUs: as placed, else (a placement from before
        GPUs were shared, which booked the whole card) its plan's figure, else 0 (unknown here)."""
        planned = round(self.placed.spec.gib_per_gpu * 1024)
        return [(g.index, g.mib or planned) for g in self.placed.gpus if g.node == self.node]

    @property
    def booked_mib(self) -> int:
        """MiB the replica booked on this node's GPUs together; 0 where any is a whole card (no
        other replica shares it, so no booking is there to be over)."""
        refs = [g for g in self.placed.gpus if g.node == self.node]
        return sum(g.mib for g in refs) if refs and all(g.mib for g in refs) else 0

    def report(self, state: m.ReplicaState, detail: str = "", observed_kv_tokens: int = 0,
               observed_memory_mib: int = 0) -> None:
        self.state = state
        self.outbox.put(m.ReplicaStateChanged(
            at=m.utcnow(), replica_id=self.replica_id, model=self.placed.model, node=self.node,
            state=state, endpoint=self.endpoint if state == "healthy" and self.rank == 0 else "", detail=detail,
            restarts=self.restarts, observed_kv_tokens=observed_kv_tokens,
            head_address=self.head_address if self.multi and self.rank == 0 else "",
            observed_memory_mib=observed_memory_mib,
        ))
        log.info("engine %s%s: %s %s", self.replica_id, f" part {self.rank}" if self.multi else "", state, detail)

    def _last_lines(self) -> str:
        return " | ".join(failure_tail(self.tail, self.config.log_lines)) or "(no output)"

    async def _pump(self, stream: asyncio.StreamReader, sink: RotatingLog | None) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if text:
                self.tail.append(text[-300:])
            if sink is not None:
                sink.write(line)

    def _open_log(self) -> RotatingLog | None:
        if self.config.log_dir is None:
            return None
        return RotatingLog(self.config.log_dir / f"{subjects.token(self.replica_id)}.log",
                           self.config.log_max_bytes, self.config.log_keep)

    def _argvs(self) -> tuple[list[list[str]], dict[str, str]]:
        host, spec = self.config.host, self.placed.spec
        self.port = free_port(host)
        load_ms = self.config.fake_lora_load_ms or 0.0
        env = engine_env(spec, simulate=self.config.simulate)
        if not self.multi:
            return [engine_argv(spec, self.port, host, self.config.cmds, simulate=self.config.simulate,
                                name=self.replica_id, startup_s=self.config.fake_startup_s,
                                models_dir=self.config.models_dir, cpu=self.config.cpu, lora_load_ms=load_ms)], env
        rendezvous = free_port(host) if self.rank == 0 else 0
        if self.rank == 0:
            self.head_address = f"{self.config.advertise_host}:{rendezvous}"
        argvs = part_argvs(spec, self.rank, self.port, host, self.config.cmds, simulate=self.config.simulate,
                           name=self.replica_id, head_address=self.head_address, rendezvous_port=rendezvous,
                           startup_s=self.config.fake_startup_s, cpu=self.config.cpu, lora_load_ms=load_ms)
        return argvs, {**head_env(self.config.check_host, rendezvous), **env} if self.rank == 0 else {}

    async def _start(self) -> list[asyncio.Task[None]]:
        argvs, extra_env = self._argvs()
        env = dict(os.environ, **self.config.env, **extra_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in self.placed.gpus if g.node == self.node)
        self.endpoint = f"http://{self.config.advertise_host}:{self.port}"
        self._new_key(env)
        self.tail.clear()
        self.procs, self._ended = [], set()
        pumps: list[asyncio.Task[None]] = []
        for i, argv in enumerate(argvs):
            self.tail.append(f"$ {shlex.join(argv)}")
            sink = self._open_log()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=die_with(os.getpid()),
                )
            except OSError as e:
                if sink is not None:
                    sink.close()
                key = "ray" if argv[:len(self.config.cmds["ray"])] == self.config.cmds["ray"] else self.placed.spec.engine
                self.tail.append(f"cannot start {argv[0]}: {e.strerror or e}; install it or set --engine-cmd {key}=…")
                raise
            self.procs.append(proc)
            pumps.append(asyncio.create_task(self._pump_to(proc, sink)))
            if i < len(argvs) - 1 and not await self._joined():  # the Ray head is up before vLLM starts
                break
        return pumps

    def _new_key(self, env: dict[str, str]) -> None:
        """A new API key for this start, in the engine's environment; the routers learn it before the engine
        starts (the outbox delivers in order, so before its endpoint), the agent's own checks send it too."""
        self.engine_keys.pop(self._check_base, None)  # the last start's address
        self.api_key = secrets.token_urlsafe(32)
        env.update(api_key_env(self.placed.spec, self.api_key, simulate=self.config.simulate))
        self._check_base = f"http://{self.config.check_host}:{self.port}"
        self.engine_keys[self._check_base] = self.api_key
        if self.rank == 0:  # the head serves; the other parts of a replica over nodes take no requests
            self.outbox.put(m.EngineKeyIssued(at=m.utcnow(), replica_id=self.replica_id, node=self.node,
                                              key=self.api_key, endpoint=self.endpoint,
                                              restarts=min(self.restarts, 1_000_000)))

    async def _pump_to(self, proc: asyncio.subprocess.Process, sink: RotatingLog | None) -> None:
        try:
            assert proc.stdout is not None
            await self._pump(proc.stdout, sink)
        finally:
            if sink is not None:
                sink.close()

    def _exited(self) -> bool:
        return not self.procs or any(p.returncode is not None for p in self.procs)

    async def _joined(self) -> bool:
        """A part is up once its process says it joined (Ray: "Ray runtime started"; fake: "joined")."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.health_timeout_s
        while loop.time() < deadline:
            if self._exited():
                return False
            if any(marker in line for line in self.tail for marker in JOINED_MARKERS):
                return True
            await asyncio.sleep(min(self.config.health_interval_s, 0.2))
        self.tail.append(f"did not join within {self.config.health_timeout_s:g}s")
        return False

    async def _observe(self) -> int:
        """KV tokens the engine reserved: vLLM's cache_config_info on /metrics, llama.cpp's n_ctx on
        /props (it allocates exactly that many cells); 0 when it does not say."""
        base = f"http://{self.config.check_host}:{self.port}"
        llama = self.placed.spec.engine == "llama.cpp" and not self.config.simulate
        try:
            async with (await self._http()).get(base, "/props" if llama else "/metrics", total_s=5) as r:
                if r.status != 200:
                    return 0
                text = (await r.content.read(4 << 20)).decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError):
            return 0
        return kv_tokens_from_props(text) if llama else kv_tokens_from_metrics(text)

    async def _observe_memory(self) -> tuple[int, str]:
        """(MiB, source) the engine holds on its GPUs here; 0 when unknown.

        NVML's figure for its processes and their children on a real node ("nvml"); on a simulated
        node a real engine runs on the host's CPU, and its process tree's resident memory stands in
        ("rss"); a fake engine holds what it booked ("booked": the simulated driver shows the same).
        """
        if self.config.simulate:
            return sum(mib for _, mib in self.booked_per_gpu()), "booked"
        live = [p.pid for p in self.procs if p.returncode is None]
        if not live:
            return 0, ""
        pids = await asyncio.to_thread(descendants, live)
        if self.config.cpu:
            return await asyncio.to_thread(resident_mib, pids), "rss"
        if self.memory_of is None:
            return 0, ""
        try:
            # Bounded: a driver call that hangs must not hold back the healthy report.
            async with asyncio.timeout(10):
                return await self.memory_of(pids, self.gpu_indexes), "nvml"
        except Exception as e:  # noqa: BLE001 - a figure for people: never worth the state report
            log.warning("engine %s: GPU memory not observed: %s", self.replica_id, e)
            return 0, ""

    def _report_memory(self, used: int, source: str) -> None:
        """Report the engine healthy with what it holds, then judge that against its booking."""
        self.used_mib = self._reported_mib = used
        self.report("healthy", observed_kv_tokens=self._kv_tokens, observed_memory_mib=used)
        self._judge(used, source)

    def _judge(self, used: int, source: str) -> None:
        """Publish an over-booking when what the engine holds first goes past its booking's margin."""
        booked = self.booked_mib
        if booked and used > booked * (1 + m.OVERBOOK_MARGIN) and not self.overbooked:
            self.overbooked = True
            self.crossings += 1
            pid = self.proc.pid if self.proc is not None else 0
            log.warning("engine %s on %s holds %d MiB (%s) but booked %d MiB: %.0f%% over, past the %.0f%% "
                        "margin; the GPU's other tenants may run out of memory", self.replica_id, self.node, used,
                        source, booked, 100 * (used / booked - 1), 100 * m.OVERBOOK_MARGIN)
            self.outbox.put(m.ReplicaOverBooked(
                at=m.utcnow(), replica_id=self.replica_id, model=self.placed.model, node=self.node,
                booked_mib=min(booked, m.MIB_MAX), used_mib=min(used, m.MIB_MAX),
                source="rss" if source == "rss" else "nvml"),
                # Once per crossing of this engine process: a retry after a lost ack is stored once.
                msg_id=f"ReplicaOverBooked:{self.replica_id}:{self.node}:{pid}:{self.crossings}")
        elif self.overbooked and used <= booked:
            self.overbooked = False  # back within its booking: the next crossing is a new event

    async def _refresh_memory(self) -> None:
        """While healthy: read the engine's memory every ``memory_every_s``; report it again only when
        it moved by more than ``MEMORY_MOVED`` (or ``MEMORY_MOVED_MIB``), so the stream is not flooded."""
        while True:
            await asyncio.sleep(self.config.memory_every_s)
            used, source = await self._observe_memory()
            if used <= 0:
                continue  # unknown this time: nothing to say
            self.used_mib = used
            last = self._reported_mib
            if abs(used - last) > max(MEMORY_MOVED_MIB, MEMORY_MOVED * last):
                self._report_memory(used, source)
            else:
                self._judge(used, source)  # a creep in small steps still crosses the margin once

    async def _ask_kv_again(self) -> None:
        """What it reserved, when the read at its healthy report came back empty (a /metrics that answered
        late on a loaded host): asked again for a while, and reported once it says."""
        for _ in range(KV_RETRIES if self._kv_tokens == 0 and self._asks_kv else 0):
            await asyncio.sleep(KV_RETRY_S)
            if (kv := await self._observe()) > 0:
                self._kv_tokens = kv
                self._report_memory(*await self._observe_memory())
                return

    async def _serve(self) -> None:
        """Until any of its processes exits, reading its memory (and a reservation not yet read) meanwhile."""
        tasks = [asyncio.create_task(self._refresh_memory(), name=f"memory-{self.replica_id}"),
                 asyncio.create_task(self._ask_kv_again(), name=f"kv-{self.replica_id}")]
        try:
            await self._any_exit()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _http(self) -> Upstream:
        if self.http is None:
            self.http = Upstream(Timeouts(connect_s=5.0, read_s=CHECK_S), keys=lambda ep: self.engine_keys.get(ep))
        await self.http.start()  # started once; again is a no-op
        return self.http

    async def _healthy(self, http: Upstream) -> bool:
        """/health answers 200, then a one-token completion does too; ``check_problem`` says what did not."""
        base = f"http://{self.config.check_host}:{self.port}"
        self.check_refused = False
        try:
            async with http.get(base, "/health", total_s=CHECK_S) as r:
                if r.status != 200:
                    self.check_problem = f"GET /health answered {r.status}"
                    return False
            body = json.dumps({"model": self.placed.spec.name, "prompt": "ping", "max_tokens": 1}).encode()
            async with http.post(base, "/v1/completions", body, {"Content-Type": "application/json"},
                                 total_s=CHECK_S) as r:
                if r.status != 200:
                    text = (await r.content.read(300)).decode(errors="replace").strip()
                    self.check_problem = f"POST /v1/completions (model {self.placed.spec.name!r}) answered {r.status}: {text}"
                    self.check_refused = 400 <= r.status < 500 and r.status not in (408, 429)
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError) as e:
            self.check_problem = f"no answer ({type(e).__name__})"
            return False

    async def _wait_healthy(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.health_timeout_s
        self.check_problem, refused_since = "not checked yet", None
        http = await self._http()
        tries = 0
        while loop.time() < deadline:
            if self._exited():
                return False
            if await self._healthy(http):
                return True
            refused_since = (refused_since or loop.time()) if self.check_refused else None
            if refused_since is not None and loop.time() - refused_since >= self.config.health_refused_s:
                self.tail.append(f"the engine is up but refuses the health check for "
                                 f"{self.config.health_refused_s:g}s: {self.check_problem}")
                return False
            # Soon at first: a small model (or a wake) is up in well under a second, and every
            # poll missed is latency added to the request that woke it; vLLM's minutes get the full interval.
            await asyncio.sleep(min(self.config.health_interval_s, 0.02 * 2 ** tries))
            tries = min(tries + 1, 30)  # 0.02 x 2**30 is past any interval; 2**1024 would overflow
        self.tail.append(f"not healthy within {self.config.health_timeout_s:g}s; last: {self.check_problem}")
        return False

    async def stop(self) -> None:
        """End every process group this run started (last first): SIGTERM while its leader runs, SIGKILL
        what is left once the leader is gone or after ``STOP_S``, and wait (bounded) until none is left.

        A leader that died alone (``kill -9``) leaves its children behind, holding the card's memory
        and the output pipe: its group is killed all the same."""
        for proc in reversed(self.procs):
            if proc.pid in self._ended:
                continue
            if proc.returncode is None:
                kill_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOP_S):
                        await exited(proc)
            kill_group(proc.pid, signal.SIGKILL)
            await exited(proc)
            await self._gone(proc.pid)
            self._ended.add(proc.pid)

    async def _gone(self, pgid: int) -> None:
        """Until no process of the group is left, SIGKILLing any it forked meanwhile; bounded by ``GONE_S``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GONE_S
        while left := await asyncio.to_thread(group_members, pgid):
            if loop.time() >= deadline:
                log.warning("engine %s: processes %s of its group are still there %gs after SIGKILL",
                            self.replica_id, ", ".join(map(str, sorted(left))), GONE_S)
                return
            kill_group(pgid, signal.SIGKILL)
            await asyncio.sleep(0.05)

    async def _any_exit(self) -> None:
        """Until any of the run's processes exits: seen from the process, not from its pipes, which
        the children it leaves behind hold open."""
        waits = [asyncio.ensure_future(exited(p)) for p in self.procs]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _drain(self, pumps: list[asyncio.Task[None]]) -> None:
        """The engines' last lines, for the report; a pipe that a process outside the group still holds
        is given up after ``DRAIN_S``."""
        if not pumps:
            return
        _, held = await asyncio.wait(pumps, timeout=DRAIN_S)
        for pump in held:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if held:
            log.warning("engine %s: its output is still held open %gs after its group ended (a process "
                        "that left the group); not read further", self.replica_id, DRAIN_S)

    async def _take_turn(self) -> str:
        """Wait while another engine is starting on one of this run's GPUs (``StartTurns``)."""
        if self.turns is None:
            return ""

        def waiting(other: str, gpu: int) -> None:
            self.report("starting", f"waiting for {other} to finish starting on GPU {gpu} (engines sharing "
                                    "a card start one at a time)")

        limit = self.config.share_wait_s or self.config.health_timeout_s
        return await self.turns.take(self.replica_id, self.gpu_indexes, limit, waiting)

    def _turn_done(self) -> None:
        if self.turns is not None:
            self.turns.done(self.replica_id)

    async def run(self) -> None:
        """Start (in turn, where GPUs are shared), check, watch, restart with back-off; report failed
        when restarts run out."""
        try:
            while True:
                late = await self._take_turn()
                self.report("starting", "; ".join(x for x in (f"restart {self.restarts}" if self.restarts else "",
                                                              late) if x))
                try:
                    pumps = await self._start()
                except OSError:
                    self.report("failed", self._last_lines())
                    return
                if self.multi:
                    # Replay shows what each node runs; the head's report carries the address the others join.
                    ran = " && ".join(line[2:] for line in self.tail if line.startswith("$ "))
                    self.report("starting", f"part {self.rank + 1} of {len(self.placed.nodes)}: {ran}")
                worker = self.multi and self.rank > 0
                up = await (self._joined() if worker else self._wait_healthy())
                if up:
                    self._asks_kv = not worker
                    self._kv_tokens = 0 if worker else await self._observe()
                    self._report_memory(*await self._observe_memory())
                self._turn_done()  # healthy, or given up: the next engine on these GPUs may start
                if up:
                    await self._serve()
                await self.stop()
                await self._drain(pumps)
                code = next((p.returncode for p in self.procs if p.returncode not in (None, -signal.SIGTERM)),
                            self.proc.returncode if self.proc else None)
                if self.restarts >= self.config.max_restarts:
                    self.report("failed", f"{exit_reason(code, self.tail)} after {self.restarts} restarts: "
                                          f"{self._last_lines()}")
                    return
                self.restarts += 1
                delay = min(self.config.backoff_base_s * 2 ** (self.restarts - 1), self.config.backoff_max_s)
                self.report("unhealthy", f"{exit_reason(code, self.tail)}; restart {self.restarts} of "
                                         f"{self.config.max_restarts} in {delay:g}s: {self._last_lines()}")
                await asyncio.sleep(delay)
        finally:
            self._turn_done()
            await asyncio.shield(self.stop())
            self.engine_keys.pop(self._check_base, None)
