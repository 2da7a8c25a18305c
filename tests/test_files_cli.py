"""``ctl model prefetch|pin|unpin|files`` through the CLI, against a real nats-server and a real agent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from running import running
from streams import stored
from test_files import agent_with, finished, gguf_spec, hub, keeper_for  # noqa: F401 - hub: a fixture

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.fleetfile import inventory, load

NODE = "h100-a-03"


async def ctl(settings: Settings, *args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli, ["ctl", "model", *args, "--nats-url", settings.nats_url])


@pytest.mark.usefixtures("hub")
async def test_prefetch_pin_and_files_as_an_operator_sees_them(
        bus: Bus, settings: Settings, fleet_file: Path, tmp_path: Path) -> None:
    fleet = load(fleet_file)
    for n in fleet.nodes:
        if n.name != NODE:
            await bus.publish(inventory(n, m.utcnow()))
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=gguf_spec()))
    result = await ctl(settings, "files")
    assert result.exit_code == 0, result.output
    assert result.output == "tiny          -  on 0 nodes\n"
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        result = await ctl(settings, "prefetch", "tiny", "--nodes", NODE)
        assert result.exit_code == 0, result.output
        assert result.output.startswith("asked 1 node to fetch tiny's files (control #")
        assert result.output.endswith(f"): {NODE} fetch\n")
        (done,) = await finished(bus)
        assert done.ok
        await keeper.outbox.flush()  # type: ignore[union-attr]
        result = await ctl(settings, "pin", "tiny")
        assert result.exit_code == 0 and result.output.startswith("pinned tiny: no agent evicts its files"), result.output
        result = await ctl(settings, "files")
        assert result.output == f"tiny    0.3 MiB  on 1 node: {NODE}  (pinned)\n"
        (row,) = json.loads((await ctl(settings, "files", "tiny", "--json")).output)
        assert (row["name"], row["source"], row["nodes"], row["pinned"], row["fetching"], row["failed"]) == (
            "tiny", "acme/tiny-GGUF", [NODE], True, [], [])
        again = await ctl(settings, "prefetch", "tiny", "--nodes", NODE)
        assert again.output.endswith(f"): none fetch; {NODE} hold them already\n"), again.output
    result = await ctl(settings, "unpin", "tiny")
    assert result.exit_code == 0, result.output
    events = await stored(bus, subjects.STREAM_CONTROL, limit_s=10)
    assert [e.pinned for e in events if isinstance(e, m.ModelPinned)] == [True, False]


async def test_prefetch_mistakes_are_errors(bus: Bus, settings: Settings, fleet_file: Path) -> None:
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=gguf_spec()))
    for args, said in [
        (("prefetch", "nope"), "Error: no model named 'nope' is declared (declared: tiny); deploy it first with "
                                "`llmgw ctl model deploy nope MODEL --from-plan`"),
        (("prefetch", "tiny", "--nodes", "gpu-9"), "Error: no node named gpu-9 has reported (nodes: none reported yet)"),
        (("prefetch", "tiny", "--nodes", "gpu-9", "--all"), "Error: name nodes with --nodes or ask every node with --all, not both"),
        (("prefetch", "tiny"), "Error: no node has H100-80GB GPUs, where tiny is placed; name nodes with --nodes or ask every node with --all"),
        (("unpin", "tiny"), "Error: tiny is not pinned (pinned: none)"),
    ]:
        result = await ctl(settings, *args)
        assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == said, (args, result.output)


async def test_a_plan_says_on_how_many_nodes_each_candidates_files_are(
        bus: Bus, settings: Settings, fleet_file: Path, tmp_path: Path) -> None:
    import msgspec

    from llmgw.ctl import files, plan_locally
    from llmgw.engine.demomodel import write_demo_model

    demo = write_demo_model(tmp_path / "tiny", context=2048)
    reply = plan_locally(str(demo.weights.parent), fleet_file, m.PlanRequest(model=str(demo.weights.parent),
                                                                             context=1024), None)
    reply = msgspec.structs.replace(reply, candidates=tuple(
        msgspec.structs.replace(c, source="acme/tiny-GGUF") for c in reply.candidates))
    assert await files.plan_files(settings, reply) == []  # no agent keeps files: nothing said
    held = next(c.file for c in reply.candidates if c.file)
    await bus.publish(m.NodeFilesReported(at=m.utcnow(), node=NODE, sources=(m.HeldSource(
        source="acme/tiny-GGUF", store="models-dir", size=10, files=(m.HeldFile(path=held, size=10),)),)))
    lines = await files.plan_files(settings, reply)
    assert f"files: acme/tiny-GGUF {held} files on 1 node ({NODE})" in lines
    assert len(lines) == len({(c.source, c.file) for c in reply.candidates})
    assert all(line.endswith("files on no node: a placement downloads them first") for line in lines
               if f" {held} " not in line)


def test_simulated_agents_sharing_one_disk_cannot_all_keep_files(fleet_file: Path) -> None:
    result = CliRunner().invoke(cli, ["agent", "--simulate", str(fleet_file), "--keep-files"])
    assert result.exit_code == 2
    assert "--keep-files with --simulate needs --node: simulated agents in one process share one disk" in result.output


def test_a_files_event_is_believed_only_on_its_own_nodes_subject() -> None:
    ev = m.NodeFilesReported(at=m.utcnow(), node="n1")
    assert subjects.subject_for(ev) == "llmgw.fleet.n1.files"
    assert subjects.disagrees("llmgw.fleet.n1.files", ev) is None
    assert subjects.disagrees("llmgw.fleet.n2.files", ev) == (
        "NodeFilesReported names node 'n1' but was published on 'llmgw.fleet.n2.files': the subject's node and the "
        "payload's must agree")
    done = m.DownloadFinished(at=m.utcnow(), node="n1", model="x", source="a/b", ok=True)
    assert subjects.disagrees("llmgw.fleet.n1.evicted", done) is not None
    from llmgw.bus import natsconf

    agent = natsconf.permissions("agent", "n1")["publish"]  # type: ignore[index]
    assert {"llmgw.fleet.n1.files", "llmgw.fleet.n1.download", "llmgw.fleet.n1.evicted"} <= set(agent["allow"])
    assert "llmgw.control.model.>" in agent["deny"]  # no agent asks for a prefetch or a pin
    cli_role = natsconf.permissions("cli")["publish"]  # type: ignore[index]
    assert {"llmgw.control.model.*.prefetch", "llmgw.control.model.*.pinned"} <= set(cli_role["allow"])


def test_an_agent_keeping_files_points_its_engines_at_them_and_keeps_them_offline(tmp_path: Path) -> None:
    from llmgw.cli.agent import _services

    opts = {"engines": "real", "simulated": False, "engine_cmds": {}, "engine_startup_s": 0.0,
            "engine_env": {"NCCL_SOCKET_IFNAME": "ib0"}, "log_dir": None, "log_max_bytes": 1, "log_keep": 0,
            "keep_files": True, "models_dir": tmp_path / "models", "hf_cache": tmp_path / "hf", "cache_max_gib": 1.0}
    engines, keeper = _services("n1", opts)  # type: ignore[misc]
    assert engines.config.env == {"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert engines.config.models_dir == keeper.config.models_dir == tmp_path / "models"
    assert keeper.config.cache_max_bytes == 1 << 30 and engines.files_ready == keeper.ready
    assert _services("n1", {**opts, "keep_files": False})[0].files_ready is None


def test_ctl_status_says_on_how_many_nodes_each_models_files_are_and_what_downloads() -> None:
    import io

    import msgspec
    from rich.console import Console

    from llmgw.cli.status import render
    from llmgw.fleet.state import FleetState, apply
    from llmgw.fleet.status import report

    state = FleetState()
    apply(state, m.ModelDeclared(at=m.utcnow(), spec=m.ModelSpec(
        name="tiny", source="acme/tiny", precision="q4_K_M", engine="llama.cpp", gpu_class="L4-24GB", context=2048)))
    r = report(state)
    (s,) = r.model_list
    fetch = m.FileFetch(node="n1", done=1 << 29, total=1 << 30, rate=50 * (1 << 20))
    r = msgspec.structs.replace(r, model_list=(msgspec.structs.replace(s, files_nodes=2, fetching=(fetch,)),))
    out = io.StringIO()
    render(r, Console(file=out, width=160), limit=20)
    text = out.getvalue()
    assert "files on" in text and "2 nodes" in text
    assert "downloading tiny on n1: ██████████░░░░░░░░░░ 50% of 1.00 GiB at 50.0 MiB/s" in text
