"""One agent lies about other nodes under the shipped roles; nobody believes it, and every view says the same.

A real nats-server runs the rendered nats.conf. The agent of h100-a-01 publishes,
on the subjects its user may use, an inventory that empties h100-a-02, a state
report that points the model's traffic at its own endpoint, and a ``stopped``
for a replica that is not its own; it tries a ``NodeLost`` for h100-a-02 on its
own ``.lost`` subject. Then the live projector (DuckDB and its status service),
``ctl status --replay``, a projector run from scratch, the scheduler's fold and
the router's pool are compared: all refuse the same events, count them, and
route to the replica's real endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from faultkit import tables

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus, natsconf
from llmgw.bus.server import EmbeddedServer
from llmgw.cli.natsconf import declare_streams
from llmgw.config import Settings
from llmgw.ctl import replay_state
from llmgw.errors import PermissionDeniedError
from llmgw.fleet.replay import replay
from llmgw.fleet.status import report
from llmgw.projections import runner
from llmgw.projections.store import Store
from llmgw.router.endpoints import EndpointSink

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLEET = fleetfile.load(ROOT / "examples" / "fleet.toml")
NODES = [n.name for n in FLEET.nodes]
AT = datetime(2026, 3, 1, tzinfo=UTC)
LIAR, VICTIM = "h100-a-01", "h100-a-02"
SPEC = m.ModelSpec(name="qwen", source="Qwen/Qwen3-8B", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                   context=4096)
REAL, EVIL = f"http://{VICTIM}:8000", "http://attacker.example:8000"


async def test_an_agent_cannot_speak_for_another_node(tmp_path: Path, record: Callable[..., None]) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text(natsconf.render(NODES, store_dir=str(tmp_path / "js")))
    passwords = natsconf.make_passwords(NODES)
    server = EmbeddedServer(tmp_path / "data", port=0, config_file=conf, env=passwords, extra_args=("-m", "0"))
    server.start()

    def settings(user: str) -> Settings:
        return Settings(nats_url=server.url, user=user, password=passwords[natsconf.password_env(user)],
                        connect_timeout_s=2, request_timeout_s=5)

    buses: dict[str, Bus] = {}
    projector_task: asyncio.Task[None] | None = None
    try:
        # Only admin declares streams; every other role finds them.
        declared = await asyncio.to_thread(CliRunner().invoke, declare_streams, [
            "--nats-url", server.url, "--nats-user", "admin", "--nats-password", passwords["LLMGW_PW_ADMIN"]])
        assert declared.exit_code == 0, declared.output
        for user in ("projector", "scheduler", "router", "cli", f"agent-{LIAR}", f"agent-{VICTIM}"):
            buses[user] = await Bus.connect(settings(user), f"fault-{user}", reconnect=False)
        liar, victim, sched, cli = buses[f"agent-{LIAR}"], buses[f"agent-{VICTIM}"], buses["scheduler"], buses["cli"]
        await buses["projector"].ensure_streams(lease=False)  # what `llmgw project` does at start: a check, no change
        live_db = tmp_path / "live.duckdb"
        projector = runner.Projector(buses["projector"], Store(live_db), commit_interval_s=0.1)
        projector_task = asyncio.create_task(projector.run_forever())

        # The honest fleet: two nodes, a model, its replica on h100-a-02, healthy at its real endpoint.
        for node, bus in ((LIAR, liar), (VICTIM, victim)):
            await bus.publish(fleetfile.inventory(FLEET.node(node), AT))
        await cli.publish(m.ModelDeclared(at=AT, spec=SPEC))
        await sched.publish(m.ReplicaPlaced(at=AT, replica_id="qwen-r1", model="qwen", nodes=(VICTIM,), spec=SPEC,
                                            gpus=(m.GpuRef(node=VICTIM, index=0, uuid="GPU-x"),)))
        await victim.publish(m.ReplicaStateChanged(at=AT, replica_id="qwen-r1", model="qwen", node=VICTIM,
                                                   state="healthy", endpoint=REAL))

        # The lies, each on a subject the liar's user may publish on.
        empty = msgspec.structs.replace(fleetfile.inventory(FLEET.node(VICTIM), AT), gpus=(), boot_id="liar")
        lies: list[tuple[str, m.Event]] = [
            (subjects.fleet(LIAR, "inventory"), empty),
            (subjects.replica("qwen-r1", "state", LIAR),
             m.ReplicaStateChanged(at=AT, replica_id="qwen-r1", model="qwen", node=LIAR, state="healthy", endpoint=EVIL)),
            (subjects.replica("qwen-r1", "state", LIAR),
             m.ReplicaStateChanged(at=AT, replica_id="qwen-r1", model="qwen", node=VICTIM, state="healthy", endpoint=EVIL)),
            (subjects.replica("qwen-r1", "state", LIAR),
             m.ReplicaStateChanged(at=AT, replica_id="qwen-r1", model="qwen", node=LIAR, state="stopped")),
        ]
        for i, (subject, event) in enumerate(lies):
            await liar.publish_bytes(subject, m.encode(event), f"lie-{i}")
        lost_refused = False
        try:
            await liar.publish_bytes(subjects.fleet(LIAR, "lost"), m.encode(m.NodeLost(at=AT, node=VICTIM)), "lie-lost")
        except PermissionDeniedError:
            lost_refused = True
        # The same lie with rights the liar does not have (an older conf, a stolen scheduler login).
        await sched.publish_bytes(subjects.fleet(LIAR, "lost"), m.encode(m.NodeLost(at=AT, node=VICTIM)), "lie-lost-2")
        refused_events = len(lies) + 1

        heads = {s: await cli.stream_last_seq(s) for s in subjects.HISTORY_STREAMS}
        live = m.STATUS_REPORT_DECODER.decode(await cli.request(
            subjects.STATUS, m.encode(m.StatusRequest(now=AT, wait_for=heads, wait_s=10)), timeout=15))
        c = await replay(cli)
        replayed = report(c.state, AT, live.idle_threshold_s, c.cursor, history=c.history)
        scheduler_view = await replay_state(sched)
        sink = EndpointSink(buses["router"])
        follow = asyncio.create_task(sink.run())
        async with asyncio.timeout(15):
            await sink.caught_up.wait()
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        projector_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await projector_task
        assert projector.store is not None
        rows = projector.store.query("SELECT subject, error FROM unprojected_events ORDER BY stream, seq")
        projector.store.close()
        clean_db = tmp_path / "clean.duckdb"
        await runner.Projector(buses["projector"], Store(clean_db)).run_once()
    finally:
        if projector_task is not None and not projector_task.done():
            projector_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await projector_task
        for bus in buses.values():
            await bus.close()
        server.stop()

    # Nobody believed a lie: the victim keeps its GPUs and is not lost; the replica stays at its real endpoint.
    for view in (live, replayed):
        assert view.lost_nodes == () and view.nodes == 2
        assert view.replicas_by_state == {"healthy": 1} and view.model_states == {"qwen": "serving"}
        assert view.unprojected_events == refused_events
    assert msgspec.to_builtins(live) == msgspec.to_builtins(replayed)
    victim_view = scheduler_view.nodes[VICTIM]
    assert not victim_view.lost and len(victim_view.gpus) == FLEET.node(VICTIM).gpu_count
    assert scheduler_view.replicas["qwen-r1"].endpoint == REAL
    assert [r.endpoint for r in sink.pool.healthy["qwen"]] == [REAL]
    assert sink.refused == 2 and sink.skipped == 1  # from a node it is not on (the fold refuses it); payload vs subject
    assert sink.bad_events == 3  # what /metrics counts (llmgw_router_bad_events_total)
    assert lost_refused, "the agent may not publish NodeLost, even on its own subject"

    # The DuckDB view says the same, with the reason for each refusal; a projector from scratch agrees.
    assert len(rows) == refused_events and all("node" in error for _, error in rows)
    assert tables(live_db) == tables(clean_db)
    record(lies_stored=len(lies) + 1, lies_refused_by_nats_conf=int(lost_refused), refused_by_every_fold=refused_events,
           router_refused=sink.bad_events)

