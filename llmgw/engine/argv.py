"""What an engine is started with (vLLM, llama.cpp, Ray parts, the fake engine), and what it says it reserved.

Pure: command lines from a spec and a port, and the KV cache figures parsed from
an engine's /metrics (vLLM) or /props (llama.cpp). The supervisor that runs them
is llmgw/agent/supervisor.py; the planner prints the same command lines, with what
only a node knows filled in one fixed way (``shown_command``).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmgw import messages as m
from llmgw.engine.profiles import parse_version
from llmgw.errors import ConfigError, PlanError

ENGINE_KEYS = ("vllm", "llama.cpp", "fake", "ray")
# What a part prints once it has joined its head: Ray's `ray start`, or the fake engine's worker part.
JOINED_MARKERS = ("Ray runtime started", "joined ")
# The programs as installed on PATH, before llmgw's arguments (``--engine-cmd`` names others).
PROGRAMS: Mapping[str, tuple[str, ...]] = {"vllm": ("vllm", "serve"), "llama.cpp": ("llama-server",), "ray": ("ray",)}

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(model: str) -> bool:
    """``Org/Name``, as the Hugging Face Hub names a repository (not a path here)."""
    return _REPO_ID.match(model) is not None


def llmgw_program() -> list[str]:
    exe = Path(sys.executable).parent / "llmgw"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("llmgw")
    return [found] if found else [sys.executable, "-m", "llmgw"]


def default_commands() -> dict[str, list[str]]:
    """The program prefix each engine starts with, before llmgw's arguments."""
    return {**{key: list(argv) for key, argv in PROGRAMS.items()}, "fake": [*llmgw_program(), "fake-engine"]}


def parse_engine_cmds(values: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    """``vllm=/opt/vllm/bin/vllm serve`` → {"vllm": [...]}; a bad one is a ConfigError naming it."""
    out = default_commands()
    for raw in values:
        key, sep, cmd = raw.partition("=")
        key = key.strip()
        if not sep or key not in ENGINE_KEYS or not cmd.strip():
            raise ConfigError(
                f"--engine-cmd {raw!r}: expected ENGINE=CMD with ENGINE one of {', '.join(ENGINE_KEYS)}, "
                "e.g. --engine-cmd 'vllm=/opt/vllm/bin/vllm serve'"
            )
        argv = shlex.split(cmd)
        if key == "vllm" and Path(argv[-1]).name == "vllm":
            argv.append("serve")  # `vllm=/opt/vllm/bin/vllm` names the program; the subcommand is implied
        out[key] = argv
    return out


# What llmgw asks of every vLLM whose version has it (the version its spec was planned for;
# an unknown version gets none, since vLLM refuses a flag it does not know): the prompt's
# cached tokens in each answer's usage, which the routers count (``prompt_tokens_details``).
# and a usage chunk at the end of every stream, asked for or not, so that every streamed
# request is counted (the router takes it out again for a client that did not ask).
VLLM_FLAGS: tuple[tuple[tuple[int, ...], str], ...] = (
    ((0, 6, 4), "--enable-prompt-tokens-details"),
    ((0, 10, 0), "--enable-force-include-usage"),
)
GIB = 1 << 30

# --- LoRA adapters -----------------------------------------------------------------------------------
# What vLLM's --max-lora-rank accepts (vllm/config/lora.py ``MaxLoRARanks``); a rank between is
# rounded up, since vLLM refuses any other value (the planner sizes the buffers by the same table).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM registers /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set ("1" or
# "true", any case, vllm/envs.py); routers load adapters where they are asked for through them.
VLLM_RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
# --max-cpu-loras, the worker's host-RAM cache of adapter weights, as a multiple of --max-loras.
# vLLM's unload only forgets the name: the weights stay in that cache until its LRU drops them, and
# a name loaded again is a new entry. A cache of exactly --max-loras (vLLM's default) then holds
# the stale copies of what routers unloaded beside the live ones, and its LRU can drop a live one,
# which vLLM re-reads from disk on its next request; twice as many entries leave room for as many
# stale ones as live ones. More would only hold more stale copies, in host RAM nothing plans.
CPU_LORAS_PER_SLOT = 2


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank ``--max-lora-rank`` accepts that holds ``rank``; 0 for none. Above vLLM's largest,
    its largest: the engine then refuses such an adapter when it is loaded, saying so, rather than not starting."""
    if rank <= 0:
        return 0
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def lora_flags(spec: m.ModelSpec, *, simulate: bool = False, load_ms: float = 0.0) -> list[str]:
    """A spec's adapter flags. vLLM with ``max_adapters``: LoRA on, its slots, rank and CPU cache;
    llama.cpp: every attached adapter, in order (the order is each one's id in a request's ``lora``).
    The fake engine takes the same slots (and ``load_ms``, its time to load one), its attached
    adapters by name, one ``--lora`` each: it reads no file."""
    if spec.engine == "vllm":
        if spec.max_adapters <= 0:
            return []
        slots = str(spec.max_adapters)
        cache = ["--max-cpu-loras", str(spec.max_adapters * CPU_LORAS_PER_SLOT)]
        if simulate:
            return ["--max-loras", slots, *cache, *(("--lora-load-ms", f"{load_ms:g}") if load_ms > 0 else ())]
        rank = vllm_lora_rank(spec.max_lora_rank)  # 0: not planned, vLLM's own default (16)
        return ["--enable-lora", "--max-loras", slots, *(("--max-lora-rank", str(rank)) if rank else ()), *cache]
    if not spec.adapters:
        return []
    if simulate:
        return [arg for ref in spec.adapters for arg in ("--lora", ref.name)]
    # One --lora of comma-separated paths, as llama-server documents it: given twice, it loads both
    # but warns "specified multiple times ... only last value will be used". Its list is CSV: a path
    # holding a comma or a quote is quoted, a quote in it doubled (common/arg.cpp ``parse_csv_row``).
    return ["--lora", ",".join(_csv_field(ref.path) for ref in spec.adapters)]


def _csv_field(text: str) -> str:
    return f'"{text.replace(chr(34), chr(34) * 2)}"' if "," in text or '"' in text else text


MAX_LORA_LOAD_MS = 600_000.0


def fake_lora_load_ms(raw: str) -> float:
    """A fake engine's adapter load time as an environment gives it (LLMGW_FAKE_LORA_LOAD_MS), bounded."""
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= MAX_LORA_LOAD_MS:  # NaN too
        raise ConfigError(f"LLMGW_FAKE_LORA_LOAD_MS={raw[:40]!r}: a fake engine's adapter load time is "
                          f"milliseconds from 0 to {MAX_LORA_LOAD_MS:.0f}")
    return ms


def engine_env(spec: m.ModelSpec, *, simulate: bool = False) -> dict[str, str]:
    """What a replica's engine runs with beyond the node's environment: a vLLM serving adapters, the
    runtime LoRA endpoints (only then: vLLM warns that they are for development, and they are not
    wanted where nothing loads adapters)."""
    if spec.engine == "vllm" and spec.max_adapters > 0 and not simulate:
        return dict(VLLM_RUNTIME_LORA_ENV)
    return {}


# Where each engine reads its API key from: its environment, not its command line, which `ps` shows every
# user of the node. vLLM reads VLLM_API_KEY (its --api-key wins over it), llama-server LLAMA_API_KEY (the
# env of its --api-key); the fake engine FAKE_API_KEY_ENV (its --api-key). Each then refuses a request
# without ``Authorization: Bearer <key>`` with 401: vLLM on /v1/… (not /health, /metrics), llama-server on
# everything but /health (/v1/models, /props and /metrics included).
API_KEY_ENV = {"vllm": "VLLM_API_KEY", "llama.cpp": "LLAMA_API_KEY"}
FAKE_API_KEY_ENV = "LLMGW_FAKE_API_KEY"


def api_key_env(spec: m.ModelSpec, key: str, *, simulate: bool = False) -> dict[str, str]:
    """The environment that gives a replica's engine its API key."""
    return {FAKE_API_KEY_ENV if simulate else API_KEY_ENV.get(spec.engine, FAKE_API_KEY_ENV): key}


def vllm_flags(version: str) -> list[str]:
    """The flags of ``VLLM_FLAGS`` that vLLM ``version`` has; none for a version not recorded."""
    if not version:
        return []
    try:
        have = parse_version(version)
    except PlanError:
        return []
    return [flag for since, flag in VLLM_FLAGS if have >= since]


def engine_argv(spec: m.ModelSpec, port: int, host: str, cmds: Mapping[str, Sequence[str]], *, simulate: bool, name: str = "",
                startup_s: float = 0.0, models_dir: Path | None = None, cpu: bool = False,
                lora_load_ms: float = 0.0) -> list[str]:
    """The command line for one replica's engine (and ``engine_env`` what it runs with).

    ``cpu``: the node's GPUs are simulated and a real vLLM runs on the host's CPU. It then gets
    what a CPU engine needs, from the node rather than from typed ``--engine-arg``s: float32
    where the plan said a 16-bit type (bf16 attention on a CPU with AMX crashes vLLM's worker),
    eager mode, and its KV cache as bytes (the plan's KV figure for the simulated card) instead
    of a memory fraction, which on a CPU means a fraction of the host's RAM. ``lora_load_ms``: a
    fake engine's time to load an adapter.
    """
    if simulate:
        return [*cmds["fake"], "--host", host, "--port", str(port), "--model", spec.name, "--name", name or spec.name,
                *(("--startup-s", f"{startup_s:g}") if startup_s > 0 else ()),
                # A plausible reservation: a little under the plan, as a real engine's often is.
                *(("--kv-tokens", str(spec.kv_tokens_planned * 97 // 100)) if spec.kv_tokens_planned > 0 else ()),
                *lora_flags(spec, simulate=True, load_ms=lora_load_ms)]
    if spec.engine == "vllm":
        argv = [*cmds["vllm"], spec.source, "--tensor-parallel-size", str(spec.tp)]
        if spec.pp > 1:
            argv += ["--pipeline-parallel-size", str(spec.pp), "--distributed-executor-backend", "ray"]
        if spec.quantization:
            argv += ["--quantization", spec.quantization]
        dtype = "float32" if cpu and spec.precision in ("bf16", "fp16") else spec.dtype
        if dtype != "auto":
            argv += ["--dtype", dtype]
        if spec.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", spec.kv_cache_dtype]
        if spec.parallel:
            argv += ["--max-num-seqs", str(spec.parallel)]
        argv += ["--max-model-len", str(spec.context)]
        if not cpu:
            argv += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:g}"]
        elif spec.kv_gib_per_gpu > 0:
            argv += ["--kv-cache-memory-bytes", str(int(spec.kv_gib_per_gpu * GIB))]
        argv += ["--host", host, "--port", str(port), "--served-model-name", spec.name, *vllm_flags(spec.engine_version),
                 *lora_flags(spec)]
        if cpu and "--enforce-eager" not in spec.engine_args:
            argv.append("--enforce-eager")
        return [*argv, *spec.engine_args]
    # llama.cpp's -c is the KV pool its -np slots share: each slot gets the declared context.
    argv = [*cmds["llama.cpp"], *gguf_location(spec, models_dir), "-c", str(spec.context * spec.slots), "-np", str(spec.slots),
            "-ngl", "999", "--host", host, "--port", str(port), "--alias", spec.name, *lora_flags(spec)]
    return [*argv, *spec.engine_args]


def gguf_location(spec: m.ModelSpec, models_dir: Path | None = None) -> list[str]:
    """Where llama-server finds a spec's GGUF: ``-m PATH``, or ``--hf-repo/--hf-file`` to download it.

    A file path is taken as it is; a bare file name lives in the model's directory when the
    source is one (the planner records the file's name, and the agent runs in another
    directory than the one the operator planned in), or in ``Org__Name`` under the agent's
    models directory when the source is a repository id; only what is in neither is downloaded
    (which needs a llama-server built with curl: scripts/llama-server.sh builds one without).
    """
    source = Path(spec.source).expanduser()
    if spec.file is None:
        return ["-m", str(source)]
    file = Path(spec.file).expanduser()
    if file.is_absolute():
        return ["-m", str(file)]
    if source.is_absolute() or not is_repo_id(spec.source):
        return ["-m", str(source / file)]
    if models_dir is not None and (local := models_dir / spec.source.replace("/", "__") / file).is_file():
        return ["-m", str(local)]
    return ["--hf-repo", spec.source, "--hf-file", spec.file]


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_tokens_from_metrics(text: str) -> int:
    """num_gpu_blocks x block_size from vLLM's Prometheus ``vllm:cache_config_info``; 0 when absent."""
    found = _CACHE_INFO.search(text)
    if found is None:
        return 0
    labels = dict(_LABEL.findall(found.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return 0


def part_argvs(spec: m.ModelSpec, rank: int, port: int, host: str, cmds: Mapping[str, Sequence[str]], *, simulate: bool,
               name: str, head_address: str = "", rendezvous_port: int = 0, startup_s: float = 0.0,
               cpu: bool = False, lora_load_ms: float = 0.0) -> list[list[str]]:
    """The processes one node runs for its part of a replica over ``spec.pp`` nodes, in start order.

    vLLM: a Ray cluster per replica. The head (rank 0) runs ``ray start --head`` and then
    ``vllm serve … --distributed-executor-backend ray``, which finds it through RAY_ADDRESS;
    every other node runs ``ray start --address HEAD --block`` (``--block``: killing it
    takes down what it started). Simulated: the head's fake engine waits on a TCP port for
    the other parts; each other part connects to it and holds the connection.
    """
    if simulate:
        if rank == 0:
            return [[*engine_argv(spec, port, host, cmds, simulate=True, name=name, startup_s=startup_s,
                                  lora_load_ms=lora_load_ms),
                     "--parts", str(spec.pp), "--rendezvous-port", str(rendezvous_port)]]
        return [[*cmds["fake"], "--model", spec.name, "--name", f"{name}/part{rank}", "--join", head_address]]
    gpus = str(spec.tp)
    if rank == 0:
        return [[*cmds["ray"], "start", "--head", "--port", str(rendezvous_port), "--num-gpus", gpus, "--block"],
                engine_argv(spec, port, host, cmds, simulate=False, name=name, cpu=cpu)]
    return [[*cmds["ray"], "start", "--address", head_address, "--num-gpus", gpus, "--block"]]


def head_env(local_host: str, rendezvous_port: int) -> dict[str, str]:
    """What the head's processes run with: its vLLM joins the Ray cluster its own ``ray start --head`` made."""
    return {"RAY_ADDRESS": f"{local_host}:{rendezvous_port}"}


# --- what only a node knows, as a plan prints it ----------------------------------------------------
# A plan's command is ``engine_argv`` of its candidate's spec, with these in place of what the agent
# fills in where it runs: the programs as installed on PATH (PROGRAMS), every interface (the agent's
# default host), vLLM's default port; for a GGUF, the location of a node that holds no copy in its
# models directory; over several nodes, Ray's default port, the head's address as HEAD, and the
# address the head's engine reaches its own Ray at.
SHOWN_HOST = "0.0.0.0"
SHOWN_PORT = 8000
SHOWN_RAY_PORT = 6379
SHOWN_HEAD_ADDRESS = f"HEAD:{SHOWN_RAY_PORT}"
SHOWN_LOCAL_HOST = "127.0.0.1"


def shown_argv(spec: m.ModelSpec) -> list[str]:
    """The engine's command line for ``spec`` as a plan prints it: ``engine_argv`` with the shown node parts."""
    return engine_argv(spec, SHOWN_PORT, SHOWN_HOST, PROGRAMS, simulate=False)


def shown_command(spec: m.ModelSpec) -> str:
    """``shown_argv`` as one shell line, after what the engine's environment needs (``engine_env``)."""
    env = engine_env(spec)
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(shown_argv(spec))])


def shown_part_argvs(spec: m.ModelSpec, rank: int) -> list[list[str]]:
    """``part_argvs`` of one node of a replica over ``spec.pp`` nodes, with the shown node parts."""
    return part_argvs(spec, rank, SHOWN_PORT, SHOWN_HOST, PROGRAMS, simulate=False, name=spec.name,
                      head_address=SHOWN_HEAD_ADDRESS, rendezvous_port=SHOWN_RAY_PORT)


def shown_node_commands(spec: m.ModelSpec) -> tuple[str, ...]:
    """What each node of a replica over ``spec.pp`` nodes runs, the head first, one shell line per node:
    ``node 1 (head): ray start --head … & RAY_ADDRESS=127.0.0.1:6379 vllm serve …``; () on one node."""
    if spec.pp <= 1 or spec.engine != "vllm":
        return ()
    lines = []
    for rank in range(spec.pp):
        *before, engine = shown_part_argvs(spec, rank)
        env = {**head_env(SHOWN_LOCAL_HOST, SHOWN_RAY_PORT), **engine_env(spec)} if rank == 0 else {}
        words = [*(f"{shlex.join(argv)} &" for argv in before), *(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                 shlex.join(engine)]
        lines.append(f"node {rank + 1}{' (head)' if rank == 0 else ''}: {' '.join(words)}")
    return tuple(lines)


def kv_tokens_from_props(text: str) -> int:
    """The KV cells llama-server allocated, from its /props: each slot's context
    (``default_generation_settings.n_ctx``, or a top-level ``n_ctx``) x ``total_slots``; 0 when absent.

    With -np N it splits -c into N slots (the context is capped at the model's training
    context), so this is what it was asked for, never what the card would hold.
    """
    try:
        props = json.loads(text)
        settings = props.get("default_generation_settings") or {}
        n = settings.get("n_ctx", props.get("n_ctx", 0))
        slots = props.get("total_slots", 1)
        if not (isinstance(n, int) and 0 < n <= 1 << 32 and isinstance(slots, int) and 0 < slots <= m.MAX_PARALLEL):
            return 0
        return n * slots
    except (ValueError, AttributeError):
        return 0


_VERSION_TEXT = re.compile(r"v?(\d+(?:\.\d+){0,3}[\w.+-]*)")


def version_argv(engine: str, cmds: Mapping[str, list[str]]) -> list[str]:
    """The command that asks an engine its version: ``vllm --version``, ``llama-server --version``."""
    argv = list(cmds[engine])
    if engine == "vllm" and argv and argv[-1] == "serve":
        argv = argv[:-1]  # the program, not its serve subcommand
    return [*argv, "--version"]


def parse_version_output(text: str) -> str:
    """The version in what ``--version`` printed (vLLM: ``0.17.1``, after any log lines; llama-server:
    ``version: 4567 (abc1234)``), or "" when there is none."""
    for raw in text.splitlines():
        line = raw.strip()
        low = line.lower()
        if "version" in low:
            found = _VERSION_TEXT.search(line[low.rindex("version") + len("version"):])
        else:
            found = _VERSION_TEXT.match(line)
        if found:
            return found.group(1)[:100]
    return ""


# --- what an engine's output says when it fails -------------------------------------------------------

# Lines that say what failed: kept for the failure's report ahead of the last lines, which after a
# crash are the shutdown's chatter (vLLM: nanobind's leak report, the resource tracker's semaphores).
_FAILURE = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b|Traceback \(most recent call last\)|^\s*[\w.]*(Error|Exception)\b.*:"
                      r"|Segmentation fault|core dumped|Illegal instruction|out of memory|Killed\b")
_CHATTER = re.compile(r"nanobind: leaked|resource_tracker|leaked semaphore|There appear to be \d+ leaked")
# vLLM's front end exits 0 when its engine core died under it: the exit status says nothing then.
_ENGINE_DEAD = re.compile(r"EngineDeadError|EngineCore encountered|Engine core proc \S+ died|"
                          r"Engine core initialization failed|died unexpectedly")
FAILURE_LINES = 8  # of a failure's report: what failed, then the last lines


def failure_tail(lines: Sequence[str], last: int = 20) -> list[str]:
    """The lines a failure is reported with: those that say what failed (at most ``FAILURE_LINES``,
    the latest), then the last ``last`` lines not already among them; shutdown chatter dropped."""
    said = [ln for ln in lines if not _CHATTER.search(ln)]
    failing = [ln for ln in said if _FAILURE.search(ln)][-FAILURE_LINES:]
    shown = set(failing)
    return [*failing, *[ln for ln in said[-last:] if ln not in shown]]


def exit_reason(code: int | None, lines: Sequence[str]) -> str:
    """How an engine that was not asked to stop ended: its exit status, the signal that killed it, or,
    where vLLM says its engine died, that it failed whatever its status says."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine exited ({code}): killed by {name}"
    dead = next((ln for ln in reversed(lines) if _ENGINE_DEAD.search(ln)), None)
    if dead is not None:
        return f"engine failed: its engine core died (exit {code}): {dead.strip()[:200]}"
    return f"engine exited ({code})"
