"""``llmgw agent``: run a node agent (real NVML or simulated), inject faults, watch liveness."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw import messages as m
from llmgw.agent import (
    Agent,
    EngineConfig,
    EngineSupervisor,
    FileKeeper,
    FilesConfig,
    NvmlPort,
    RealNvml,
    SimNvml,
)
from llmgw.bus import Bus
from llmgw.cli.options import checked_name, echo_json, json_option, nats_options, run
from llmgw.config import Settings
from llmgw.engine import EnginePolicy, parse_engine_cmds
from llmgw.errors import LlmgwError
from llmgw.fleetfile import faults, load, parse_fault_kind
from llmgw.scheduler import HeartbeatMonitor


def checked_fabric(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A fabric every reader accepts, or a usage error (an agent's inventories would all be refused)."""
    if value is not None and (why := m.fabric_problem(value)) is not None:
        raise click.BadParameter(why, ctx=ctx, param=param)
    return value


def _engine_cmds(values: tuple[str, ...]) -> dict[str, list[str]]:
    try:
        return parse_engine_cmds(values)
    except LlmgwError as e:
        raise click.BadParameter(str(e), param_hint="--engine-cmd") from e


def engines_choice(simulated: bool, engines: str | None, engine_cmd: tuple[str, ...]) -> str:
    """fake or real; an --engine-cmd that would go unused is an error, never ignored."""
    if not simulated:
        if engines == "fake":
            raise click.UsageError("--engines fake runs on simulated GPUs only: add --simulate FLEET, or drop it")
        return "real"
    real = [c for c in engine_cmd if c.partition("=")[0].strip() != "fake"]  # fake=… sets the fake engine's program
    if engines != "real" and real:
        raise click.UsageError(f"--engine-cmd {real[0]!r} next to --simulate: simulated nodes run fake engines unless "
                               "you add --engines real (the real engines on the simulated GPUs)")
    return engines or "fake"


def _print_inventory(inv: m.NodeInventoryReported, as_json: bool) -> None:
    if as_json:
        echo_json(msgspec.to_builtins(inv))
        return
    from rich.console import Console
    from rich.table import Table

    title = f"{inv.node}  fabric {inv.fabric} ({inv.fabric_source})  boot {inv.boot_id}  driver {inv.driver_version or '-'}"
    table = Table(title=title, title_justify="left")
    for col in ("gpu", "class", "name", "MiB", "pci", "mig", "nvlink", "health"):
        table.add_column(col)
    for g in inv.gpus:
        health = "ok" if g.healthy else "UNHEALTHY"
        if g.reasons:
            health += ": " + "; ".join(g.reasons)
        table.add_row(str(g.index), g.gpu_class, g.name, str(g.memory_mib), g.pci_bus_id,
                      "on" if g.mig_enabled else "off", str(g.nvlink_active_links), health)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log: one row per GPU, never wrapped
    console.print(table)


def _engine_env(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum():
            raise click.UsageError(f"--engine-env {raw!r}: expected NAME=VALUE, e.g. --engine-env NCCL_SOCKET_IFNAME=ib0")
        out[key] = value
    return out


def engine_config(opts: dict[str, Any]) -> EngineConfig:
    """Fake engines on simulated nodes; real ones (``--engines real``) listen on loopback there too,
    since every simulated node is this machine, and run on its CPU (a simulated card has no GPU).
    Every engine's declaration is held to ``EnginePolicy``: the allow-list, the flags this agent's
    operator allows, model files only from its stores."""
    fake = opts["engines"] == "fake"
    on_cpu = opts["simulated"] and not fake
    config = EngineConfig(cmds=opts["engine_cmds"], simulate=fake, cpu=on_cpu, fake_startup_s=opts["engine_startup_s"],
                          env=opts["engine_env"], log_dir=opts["log_dir"],
                          log_max_bytes=opts["log_max_bytes"], log_keep=opts["log_keep"],
                          host=opts.get("engine_host") or ("127.0.0.1" if on_cpu else ""),
                          advertise_host=opts.get("advertise_host") or "", models_dir=opts.get("models_dir"))
    stores = [config.models_dir or Path.home() / ".cache" / "llmgw" / "models", opts.get("hf_cache") or _hf_cache(),
              *opts.get("model_paths", ())]
    try:
        config.policy = EnginePolicy.of(opts.get("allowed_args", ()), roots=[Path(p).expanduser() for p in stores])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--allow-engine-arg") from e
    return config


def _hf_cache() -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


def _services(node: str, opts: dict[str, Any]) -> tuple[EngineSupervisor, ...] | tuple[EngineSupervisor, FileKeeper]:
    """The node's engine supervisor and, when it keeps its model files, the file keeper it waits for."""
    engines = EngineSupervisor(node, engine_config(opts))
    if not opts.get("keep_files"):
        return (engines,)
    keeper = FileKeeper(node, FilesConfig(models_dir=opts["models_dir"], hf_cache=opts["hf_cache"],
                                          cache_max_bytes=int(opts["cache_max_gib"] * (1 << 30))))
    engines.files_ready, engines.files_held = keeper.ready, keeper.holds
    # The engines read the files the keeper verified, where it keeps them, and never fetch on their own:
    # an engine's download would be unverified, unbudgeted and hidden in its start-up.
    engines.config.env = {"HF_HUB_CACHE": str(opts["hf_cache"]), "HF_HUB_OFFLINE": "1", **engines.config.env}
    return engines, keeper


def _stop_all(agents: list[Agent]) -> None:
    for a in agents:
        a.stop()


async def _run_agents(ports: list[tuple[str, NvmlPort, str | None, str]], settings: Settings, opts: dict[str, Any]) -> None:
    bus = await Bus.connect(settings, f"llmgw-agent-{ports[0][0]}" if len(ports) == 1 else "llmgw-agent-sim")
    agents: list[Agent] = []
    try:
        agents = [
            Agent(bus, port, node, fabric=fabric, fabric_source=source, simulated=opts["simulated"],
                  heartbeat_s=opts["heartbeat_s"], poll_s=opts["poll_s"], faults=opts["faults"],
                  services=_services(node, opts))
            for node, port, fabric, source in ports
        ]
        for a in agents:
            for svc in a.services:
                if isinstance(svc, EngineSupervisor):
                    svc.fabric_of = lambda agent=a: agent.fabric
                elif isinstance(svc, FileKeeper):
                    svc.boot_id = a.boot_id  # its reports carry the agent's boot, as the inventory does
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Not in the main thread (tests, embedding): Ctrl-C then ends it the hard way.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, _stop_all, agents)
        tasks = [asyncio.create_task(a.run()) for a in agents]
        started = asyncio.ensure_future(asyncio.gather(*(a.started.wait() for a in agents)))
        waiters: list[asyncio.Future[Any]] = [*tasks, started]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        for t in tasks:
            if t.done() and t.exception():
                raise t.exception()  # type: ignore[misc]
        for a in agents:
            if a.inventory is not None:
                _print_inventory(a.inventory, opts["as_json"])
        if opts["once"]:
            for a in agents:
                await a.outbox.flush(timeout=15)
                a.stop()
        else:
            click.echo(f"{len(agents)} agent(s) running on {settings.nats_url}; Ctrl-C stops", err=True)
        await asyncio.gather(*tasks)
    finally:
        await bus.close()


@click.group("agent", invoke_without_command=True)
@click.option("--node", callback=checked_name,
              help="This node's name [default: the host name; with --simulate: every node of the file].")
@click.option("--fabric", callback=checked_fabric, help="Fabric name (wins over detection: NVLink fabric, InfiniBand subnet, else the node name).")
@click.option("--simulate", "fleet_path", type=click.Path(dir_okay=False, path_type=Path), help="Simulate the node(s) of this fleet file instead of reading NVML.")
@click.option("--heartbeat-s", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds between heartbeats.")
@click.option("--poll-s", type=click.FloatRange(min=0.1), default=5.0, show_default=True, help="Seconds between NVML health polls (XIDs arrive as events at once).")
@click.option("--engine-cmd", multiple=True, metavar="ENGINE=CMD", help="The program for an engine, repeatable: vllm=…, llama.cpp=…, fake=… (e.g. 'vllm=/opt/vllm/bin/vllm serve').")
@click.option("--engine-env", multiple=True, metavar="K=V",
              help="Set for every engine process, repeatable: NCCL_SOCKET_IFNAME=ib0, GLOO_SOCKET_IFNAME=eth0, RAY_… ")
@click.option("--engine-startup-s", type=click.FloatRange(0, 3600), default=0.0, show_default=True,
              help="With --simulate: seconds each fake engine takes to start, as a real one loads weights.")
@click.option("--engines", type=click.Choice(["fake", "real"]), default=None,
              help="With --simulate: fake engines (the default), or the real ones --engine-cmd names on the simulated "
                   "GPUs (a laptop, CI, a CPU box). Without --simulate engines are always real.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write each engine's output, line by line, to DIR/<replica>.log [default: only its last lines, "
                   "in the replica's events].")
@click.option("--log-max-mib", type=click.IntRange(1, 1 << 20), default=64, show_default=True,
              help="Rotate an engine's log when it reaches this size: <replica>.log becomes <replica>.log.1.")
@click.option("--log-keep", type=click.IntRange(0, 100), default=3, show_default=True,
              help="Rotated logs kept per engine (.log.1 … .log.N); older ones are deleted.")
@click.option("--keep-files/--no-keep-files", default=None,
              help="Report the model files on this node's disk, fetch them before an engine starts, keep the disk "
                   "budget [default: on, off with --simulate].")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), envvar="LLMGW_MODELS_DIR",
              help="Org__Name folders of GGUF files and checkpoints; where GGUFs are fetched to "
                   "[env LLMGW_MODELS_DIR; default: ~/.cache/llmgw/models].")
@click.option("--hf-cache", type=click.Path(file_okay=False, path_type=Path), envvar="HF_HUB_CACHE",
              help="The Hugging Face cache, where checkpoints are fetched to [env HF_HUB_CACHE; default: "
                   "huggingface_hub's, ~/.cache/huggingface/hub].")
@click.option("--cache-max-gib", type=click.FloatRange(0, 1 << 20), default=0.0,
              help="Disk the model files may take; the least recently used that no placed or pinned model needs "
                   "are evicted to stay within it [default: the disk's size less 5% of it, or less 10 GiB where that "
                   "is more].")
@click.option("--allow-engine-arg", "allowed_args", multiple=True, metavar="FLAG",
              help="Start engines with this argument although the allow-list refuses it (an address, a key, a path, "
                   "remote code), repeatable; write it with = (--allow-engine-arg=--log-file). docs/production.md, "
                   "\"What a cli login may make agents start\".")
@click.option("--allow-model-path", "model_paths", multiple=True, metavar="DIR", envvar="LLMGW_ALLOW_MODEL_PATH",
              type=click.Path(file_okay=False, path_type=Path),
              help="A directory engines may read model files from besides --models-dir and --hf-cache, repeatable "
                   "[env LLMGW_ALLOW_MODEL_PATH, space-separated].")
@click.option("--engine-host", envvar="LLMGW_ENGINE_HOST", metavar="ADDR",
              help="The address engines listen on [default: 0.0.0.0 on a real node, 127.0.0.1 simulated; "
                   "env LLMGW_ENGINE_HOST]. Each engine also takes its own API key, which only routers learn.")
@click.option("--advertise-host", envvar="LLMGW_ADVERTISE_HOST", metavar="HOST",
              help="The host routers dial an engine at [default: --engine-host, or the host name when that is "
                   "0.0.0.0; env LLMGW_ADVERTISE_HOST].")
@click.option("--once", is_flag=True, help="Publish the inventory, print it, and exit.")
@json_option
@nats_options
@click.pass_context
def agent(ctx: click.Context, node: str | None, fabric: str | None, fleet_path: Path | None, heartbeat_s: float,
          poll_s: float, engine_cmd: tuple[str, ...], engine_env: tuple[str, ...], engine_startup_s: float,
          engines: str | None, log_dir: Path | None, log_max_mib: int, log_keep: int, keep_files: bool | None,
          models_dir: Path | None, hf_cache: Path | None, cache_max_gib: float, allowed_args: tuple[str, ...],
          model_paths: tuple[Path, ...], engine_host: str | None, advertise_host: str | None, once: bool,
          as_json: bool, settings: Settings) -> None:
    """Report this node's GPUs (NVML) and their health to the fleet stream.

    Example:

    \b
        llmgw agent --node gpu-01 --fabric ib-a --nats-url nats://ctl:4222
        llmgw agent --simulate examples/fleet.toml
        llmgw agent --simulate examples/cpu.toml --engines real --engine-cmd "llama.cpp=$(bash scripts/llama-server.sh | tail -1)"
        llmgw agent fault h100-a-01 3 xid=79
    """
    if ctx.invoked_subcommand is not None:
        return
    cmds = _engine_cmds(engine_cmd)
    engines = engines_choice(fleet_path is not None, engines, engine_cmd)
    opts: dict[str, Any] = {"heartbeat_s": heartbeat_s, "poll_s": poll_s, "once": once, "as_json": as_json,
                            "simulated": fleet_path is not None, "faults": (),
                            "engine_cmds": cmds, "engine_startup_s": engine_startup_s,
                            "engine_env": _engine_env(engine_env), "engines": engines,
                            "log_dir": log_dir.resolve() if log_dir else None,
                            "log_max_bytes": log_max_mib * 1024 * 1024, "log_keep": log_keep,
                            "keep_files": fleet_path is None if keep_files is None else keep_files,
                            "cache_max_gib": cache_max_gib, "allowed_args": allowed_args, "model_paths": model_paths,
                            "engine_host": engine_host, "advertise_host": advertise_host}
    if opts["keep_files"] and fleet_path is not None and not node and len(load(fleet_path).nodes) > 1:
        raise click.UsageError("--keep-files with --simulate needs --node: simulated agents in one process share "
                               "one disk, and each would report the same files as its own")
    if opts["keep_files"] or models_dir is not None:
        opts["models_dir"] = (models_dir or Path.home() / ".cache" / "llmgw" / "models").expanduser().resolve()
    if opts["keep_files"] or hf_cache is not None:
        opts["hf_cache"] = (hf_cache or _hf_cache()).expanduser().resolve()
    ports: list[tuple[str, NvmlPort, str | None, str]] = []
    if fleet_path is not None:
        fleet = load(fleet_path)
        opts["faults"] = faults(fleet)
        for n in [fleet.node(node)] if node else list(fleet.nodes):
            ports.append((n.name, SimNvml(n), fabric or n.fabric, "flag" if fabric else "fleet-file"))
    else:
        ports.append((node or socket.gethostname(), RealNvml(), fabric, "flag"))
    opened: list[NvmlPort] = []
    try:
        for _, port, _, _ in ports:
            port.open()  # before NATS: no driver is the first thing to say
            opened.append(port)
        run(_run_agents(ports, settings, opts))
    finally:
        for port in opened:
            port.close()


@agent.command("fault")
@click.argument("node", callback=checked_name)
@click.argument("gpu", type=click.IntRange(0, m.MAX_GPUS - 1))
@click.argument("kind", metavar="xid=N|ecc|lost|thermal|clear")
@json_option
@nats_options
def fault(node: str, gpu: int, kind: str, as_json: bool, settings: Settings) -> None:
    """Inject a fault into a GPU of a running simulated agent, or clear a GPU's faults on any agent.

    A real (NVML) agent takes only `clear`: say it once the GPU was reset, and the
    XIDs held against it, remembered across agent restarts, are dropped.

    Example:

    \b
        llmgw agent fault h100-a-01 3 xid=79
        llmgw agent fault h100-a-01 3 clear
    """
    try:
        fkind, xid = parse_fault_kind(kind)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="KIND") from e
    from llmgw import ctl

    reply = run(ctl.inject_fault(settings, m.InjectFault(node=node, gpu=gpu, kind=fkind, xid=xid)))
    if as_json:
        echo_json(msgspec.to_builtins(reply))
        return
    state = "healthy" if reply.healthy else "UNHEALTHY"
    why = f" ({'; '.join(reply.reasons)})" if reply.reasons else ""
    change = "" if reply.changed else " (unchanged; nothing published)"
    click.echo(f"{reply.node} GPU {reply.gpu}: {state}{why}{change}")


@agent.command("liveness")
@click.option("--timeout-s", type=click.FloatRange(0.1, 86400), default=60.0, show_default=True, help="Silence after which a node is lost.")
@nats_options
def liveness(timeout_s: float, settings: Settings) -> None:
    """Publish NodeLost for nodes silent longer than --timeout-s, NodeReturned when heard again.

    Example:

        llmgw agent liveness --timeout-s 60
    """

    async def main() -> None:
        bus = await Bus.connect(settings, "llmgw-liveness")
        try:
            click.echo(f"watching heartbeats on {settings.nats_url}; lost after {timeout_s:g}s of silence", err=True)
            await HeartbeatMonitor(bus, timeout_s=timeout_s).run()
        finally:
            await bus.close()

    run(main())
