"""nats.conf roles, enforced by a real nats-server started with the rendered config.

The shipped nats.conf is ``natsconf.render`` for examples/fleet.toml (checked
byte for byte below); the server here runs the same render with a temporary
store directory and random passwords in its environment.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from nats.aio.msg import Msg

from llmgw import fleetfile, subjects
from llmgw import messages as m
from llmgw.bus import Bus, natsconf
from llmgw.bus.server import EmbeddedServer
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.errors import ConfigError, ConnectError, PermissionDeniedError

ROOT = Path(__file__).resolve().parent.parent
FLEET = fleetfile.load(ROOT / "examples" / "fleet.toml")
NODES = [n.name for n in FLEET.nodes]
ROUTERS = ["gw-1"]
AT = datetime(2026, 1, 1, tzinfo=UTC)


class Secured:
    def __init__(self, server: EmbeddedServer, passwords: dict[str, str]) -> None:
        self.server, self.passwords = server, passwords

    def settings(self, user: str, password: str | None = None) -> Settings:
        pw = password if password is not None else self.passwords[natsconf.password_env(user)]
        return Settings(nats_url=self.server.url, user=user, password=pw, connect_timeout_s=2, request_timeout_s=2)

    async def connect(self, user: str) -> Bus:
        return await Bus.connect(self.settings(user), f"test-{user}", reconnect=False)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    base = tmp_path_factory.mktemp("natsconf")
    conf = base / "nats.conf"
    conf.write_text(natsconf.render(NODES, routers=ROUTERS, store_dir=str(base / "js")))
    passwords = natsconf.make_passwords(NODES, ROUTERS)
    server = EmbeddedServer(base / "data", port=0, config_file=conf, env=passwords, extra_args=("-m", "0"))
    server.start()
    try:
        yield Secured(server, passwords)
    finally:
        server.stop()


@pytest.fixture
async def admin(secured: Secured) -> AsyncIterator[Bus]:
    bus = await secured.connect("admin")
    await bus.ensure_streams()
    try:
        yield bus
    finally:
        await bus.close()


def inventory(node: str) -> m.NodeInventoryReported:
    return fleetfile.inventory(FLEET.node(node), AT)


async def denied(bus: Bus, event: m.Event) -> str:
    """Publish an event that must be refused; the refusal, not a timeout, must come back."""
    with pytest.raises(PermissionDeniedError) as info:
        # A silent timeout would surface as PublishError after 5 s, and fail this test.
        await bus.publish(event, timeout=5)
    return str(info.value)


def test_shipped_conf_is_the_render_for_the_example_fleet() -> None:
    assert (ROOT / "nats.conf").read_text() == natsconf.render(NODES)


def test_shipped_conf_is_durable() -> None:
    text = (ROOT / "nats.conf").read_text()
    assert "sync_interval: always" in text
    assert "2.12.3" in text
    # No password literal: every password line reads the environment.
    pw_lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("password:")]
    assert len(pw_lines) == len(natsconf.users(NODES))
    assert all(ln.startswith("password: $LLMGW_PW_") for ln in pw_lines)


async def test_agent_publishes_its_own_node_only(secured: Secured, admin: Bus) -> None:
    agent = await secured.connect("agent-h100-a-01")
    try:
        ack = await agent.publish(inventory("h100-a-01"))
        assert ack.stream == subjects.STREAM_FLEET and not ack.duplicate
        await agent.publish(m.ReplicaStateChanged(at=AT, replica_id="r1", model="x", node="h100-a-01", state="healthy"))
        text = await denied(agent, inventory("h100-a-02"))
        assert "llmgw.fleet.h100-a-02.inventory" in text
        await denied(agent, m.ReplicaStateChanged(at=AT, replica_id="r1", model="x", node="h100-a-02", state="healthy"))
        # An engine over its booking is reported by its own node's agent only.
        await agent.publish(m.ReplicaOverBooked(at=AT, replica_id="r1", model="x", node="h100-a-01", booked_mib=100,
                                                used_mib=200))
        await denied(agent, m.ReplicaOverBooked(at=AT, replica_id="r1", model="x", node="h100-a-02", booked_mib=100,
                                                used_mib=200))
        await denied(agent, m.IdleMapPublished(at=AT, router="r", boot_id="b", tick=1))
        await denied(agent, m.ModelRemoved(at=AT, name="x"))
        await denied(agent, m.ReplicaPlaced(at=AT, replica_id="r1", model="x", nodes=("h100-a-01",), gpus=(),
                                            spec=m.ModelSpec(name="x", source="x", precision="bf16", engine="vllm",
                                                             gpu_class="H100-80GB", context=4096)))
        # The connection survives a refusal: the next allowed publish still works.
        await agent.publish(m.GpuHealthChanged(at=AT, node="h100-a-01", gpu_index=0, gpu_uuid="u", healthy=False))
    finally:
        await agent.close()
    assert await admin.stream_last_seq(subjects.STREAM_FLEET) == 2
    assert await admin.stream_last_seq(subjects.STREAM_CONTROL) == 2


async def test_router_cannot_publish_fleet_events(secured: Secured, admin: Bus) -> None:
    router = await secured.connect("router")
    try:
        await router.publish(m.IdleMapPublished(at=AT, router="gw-1", boot_id="b", tick=1))
        await denied(router, inventory("h100-a-01"))
        await denied(router, m.NodeLost(at=AT, node="h100-a-01"))
        await denied(router, m.ModelRemoved(at=AT, name="x"))
    finally:
        await router.close()


async def test_a_named_router_wishes_and_reports_only_for_itself(secured: Secured, admin: Bus) -> None:
    router = await secured.connect(natsconf.user_name("router", "gw-1"))
    try:
        await router.publish(m.IdleMapPublished(at=AT, router="gw-1", boot_id="b", tick=1))
        await router.publish(m.ModelWanted(at=AT, router="gw-1", boot_id="b", model="x", control_seq=0))
        await denied(router, m.ModelWanted(at=AT, router="gw-2", boot_id="b", model="x", control_seq=0))
        await denied(router, m.IdleMapPublished(at=AT, router="gw-2", boot_id="b", tick=1))
        await denied(router, m.ModelAutoscaled(at=AT, name="x", replicas=3))
    finally:
        await router.close()


async def test_only_the_scheduler_autoscales(secured: Secured, admin: Bus) -> None:
    scheduler, cli = await secured.connect("scheduler"), await secured.connect("cli")
    try:
        await scheduler.publish(m.ModelAutoscaled(at=AT, name="x", replicas=3, reason="scaled up"))
        await denied(scheduler, m.ModelScaled(at=AT, name="x", replicas=3))  # the operator's word, not its own
        await denied(cli, m.ModelAutoscaled(at=AT, name="x", replicas=3))
    finally:
        await scheduler.close()
        await cli.close()


async def test_cli_cannot_publish_fleet_events_or_delete_streams(secured: Secured, admin: Bus) -> None:
    cli = await secured.connect("cli")
    try:
        await cli.publish(m.ModelScaled(at=AT, name="qwen", replicas=2))
        await denied(cli, inventory("h100-a-01"))
        await denied(cli, m.NodeReturned(at=AT, node="h100-a-01"))
        for stream in (subjects.STREAM_FLEET, subjects.STREAM_CONTROL):
            with pytest.raises(PermissionDeniedError):
                await cli.request(f"$JS.API.STREAM.DELETE.{stream}", b"", timeout=5)
            with pytest.raises(PermissionDeniedError):
                await cli.request(f"$JS.API.STREAM.PURGE.{stream}", b"", timeout=5)
    finally:
        await cli.close()
    assert await admin.stream_last_seq(subjects.STREAM_CONTROL) >= 1  # still there


async def test_the_viewer_reads_and_asks_but_changes_nothing(secured: Secured, admin: Bus) -> None:
    """The dashboard's role under `llmgw up`: it was the CLI's, which may declare, scale and stop models."""
    viewer = await secured.connect("viewer")
    try:
        assert await read_to_end(viewer, subjects.STREAM_FLEET) >= 0
        await denied(viewer, m.ModelScaled(at=AT, name="qwen", replicas=0))
        await denied(viewer, m.ReplicaStopped(at=AT, replica_id="qwen-r1", model="qwen", reason="idle"))
        await denied(viewer, inventory("h100-a-01"))
    finally:
        await viewer.close()


async def test_scheduler_places_but_cannot_report_inventory(secured: Secured, admin: Bus) -> None:
    sched = await secured.connect("scheduler")
    try:
        await sched.ensure_streams()  # declared by admin: it only checks them
        await sched.publish(m.NodeLost(at=AT, node="h100-b-01"))
        await sched.publish(m.ModelUnplaceable(at=AT, name="x", reason="no room"))
        await denied(sched, inventory("h100-b-01"))
        kv = await sched.key_value(subjects.SCHEDULER_LEASE_BUCKET, ttl_s=10)
        revision = await kv.create("natsconf-probe", b"sched-1")
        assert await kv.get("natsconf-probe") == (b"sched-1", revision)
        await kv.delete("natsconf-probe", last=revision)
        assert await kv.get("natsconf-probe") is None
    finally:
        await sched.close()


async def test_unknown_user_and_wrong_password_are_refused(secured: Secured) -> None:
    for settings in (secured.settings("mallory", "nope"), secured.settings("agent-h100-a-01", "wrong")):
        with pytest.raises(ConnectError, match="refused the credentials"):
            await Bus.connect(settings, "test-intruder", reconnect=False)


async def test_projector_reads_every_stream_and_planner_answers_cli(secured: Secured, admin: Bus) -> None:
    agent = await secured.connect("agent-l40s-01")
    projector = await secured.connect("projector")
    planner = await secured.connect("planner")
    cli = await secured.connect("cli")
    try:
        for i in range(5):
            await agent.publish(m.GpuHealthChanged(at=AT, node="l40s-01", gpu_index=i, gpu_uuid=f"u{i}", healthy=True))
        last = await projector.stream_last_seq(subjects.STREAM_FLEET)
        seen: list[m.AnyEvent] = []
        reader = projector.reader(subjects.STREAM_FLEET, 1, stop_at=last)
        async with asyncio.timeout(15):
            async for batch in reader.batches():
                seen += [m.decode_event(x.data) for x in batch]
        assert len(seen) == last and sum(isinstance(e, m.GpuHealthChanged) and e.node == "l40s-01" for e in seen) == 5

        async def answer(data: bytes) -> bytes:
            return b'{"ok":' + str(len(data)).encode() + b"}"

        await planner.serve(subjects.PLAN, answer)
        await planner.nc.flush()
        assert msgspec.json.decode(await cli.request(subjects.PLAN, b"abc", timeout=5)) == {"ok": 3}
        # The planner may answer but not publish on its own.
        with pytest.raises(PermissionDeniedError):
            await planner.publish(m.ModelRemoved(at=AT, name="x"), timeout=5)
    finally:
        for b in (agent, projector, planner, cli):
            await b.close()


def test_gen_conf_command_writes_conf_and_credentials(tmp_path: Path) -> None:
    out, env = tmp_path / "nats.conf", tmp_path / "creds.env"
    result = CliRunner().invoke(cli, ["nats-conf", "--node", "gpu-1.example.com", "-o", str(out), "--env-file", str(env)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert '"llmgw.fleet.gpu-1~2eexample~2ecom.inventory"' in text
    names = {line.split("=")[0] for line in env.read_text().splitlines()}
    assert natsconf.password_env("agent-gpu-1~2eexample~2ecom") in names and "LLMGW_PW_SYS" in names
    bad = CliRunner().invoke(cli, ["nats-conf"])
    assert bad.exit_code == 2 and "--fleet FILE or --node NAME" in bad.output


# --- only admin changes streams; each role gets exactly the JetStream API it calls -------------

NON_ADMIN = ("projector", "planner", "scheduler", "router", "cli", "viewer", "agent-h100-a-01", "router-gw-1")


async def stream_config(admin: Bus, stream: str) -> dict[str, object]:
    return (await admin.js.stream_info(stream)).config.as_dict()


async def refused(bus: Bus, subject: str, payload: bytes = b"") -> None:
    with pytest.raises(PermissionDeniedError):
        await bus.request(subject, payload, timeout=5)


async def test_only_admin_creates_or_updates_streams(secured: Secured, admin: Bus) -> None:
    wipe = {**await stream_config(admin, subjects.STREAM_FLEET), "max_msgs": 1}
    seal = {**await stream_config(admin, subjects.STREAM_CONTROL), "sealed": True}
    projector, scheduler = await secured.connect("projector"), await secured.connect("scheduler")
    try:
        # What the adversarial run did: wipe the fleet's history, seal control for good.
        await refused(projector, subjects.js_stream("UPDATE", subjects.STREAM_FLEET), msgspec.json.encode(wipe))
        await refused(scheduler, subjects.js_stream("UPDATE", subjects.STREAM_CONTROL), msgspec.json.encode(seal))
        # Its own lease bucket neither: admin declared it, the scheduler only uses it.
        kv = await scheduler.key_value(subjects.SCHEDULER_LEASE_BUCKET, ttl_s=10)
        assert kv is not None
        lease = await stream_config(admin, natsconf.LEASE_STREAM)
        await refused(scheduler, subjects.js_stream("UPDATE", natsconf.LEASE_STREAM),
                      msgspec.json.encode({**lease, "sealed": True}))
    finally:
        await projector.close()
        await scheduler.close()
    assert (await stream_config(admin, subjects.STREAM_FLEET)).get("max_msgs") in (None, -1)
    assert not (await stream_config(admin, subjects.STREAM_CONTROL)).get("sealed")


# Every stream a role could name: ours, the key-value and object streams, and made-up ones.
EVERY_STREAM = (*natsconf.ALL_STREAMS, natsconf.LEASE_STREAM, natsconf.SNAPSHOT_STREAM, "LLMGW_NEW", "KV_X", "OBJ_X")
# What a role would give a stream it creates to read others' replies and answer their requests.
CAPTURE = {"subjects": ["_INBOX.>", subjects.STATUS, subjects.PLAN], "storage": "memory"}


async def test_the_scheduler_cannot_create_its_lease_bucket_to_capture_replies(secured: Secured, admin: Bus) -> None:
    # A fresh deployment before the bucket existed: the scheduler could create KV_LLMGW_SCHEDULER with
    # any subjects, and a stream on _INBOX.> and llmgw.status stored (and answered) other roles' requests.
    await admin.js.delete_key_value(subjects.SCHEDULER_LEASE_BUCKET)
    scheduler = await secured.connect("scheduler")
    try:
        await refused(scheduler, subjects.js_stream("CREATE", natsconf.LEASE_STREAM),
                      msgspec.json.encode({**CAPTURE, "name": natsconf.LEASE_STREAM}))
        with pytest.raises(PermissionDeniedError, match="run `llmgw declare-streams` as admin"):
            await scheduler.key_value(subjects.SCHEDULER_LEASE_BUCKET, ttl_s=10)
        names = await admin.request("$JS.API.STREAM.NAMES", b"{}", timeout=5)
        assert natsconf.LEASE_STREAM not in msgspec.json.decode(names)["streams"]
    finally:
        await scheduler.close()
        await admin.ensure_streams()  # admin declares it again, as `declare-streams` does
    info = await stream_config(admin, natsconf.LEASE_STREAM)
    assert info["subjects"] == [f"$KV.{subjects.SCHEDULER_LEASE_BUCKET}.>"]


@pytest.mark.parametrize("user", NON_ADMIN)
async def test_no_role_but_admin_manages_jetstream(secured: Secured, admin: Bus, user: str) -> None:
    bus = await secured.connect(user)
    config = msgspec.json.encode(await stream_config(admin, subjects.STREAM_FLEET))
    try:
        for stream in EVERY_STREAM:
            capture = msgspec.json.encode({**CAPTURE, "name": stream})
            for verb in ("CREATE", "UPDATE", "DELETE", "PURGE", "SNAPSHOT", "RESTORE"):
                if (user, verb, stream) == ("projector", "PURGE", natsconf.SNAPSHOT_STREAM):
                    continue  # its retention purges old snapshots' chunks: the one purge it may send
                await refused(bus, subjects.js_stream(verb, stream), config)
                await refused(bus, subjects.js_stream(verb, stream), capture)
        for subject in ("$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
                        subjects.js_api("CONSUMER.NAMES", subjects.STREAM_CONTROL),
                        subjects.js_api("CONSUMER.LIST", subjects.STREAM_CONTROL),
                        subjects.js_api("CONSUMER.DURABLE.CREATE", subjects.STREAM_CONTROL, "durable-x"),
                        subjects.js_consumer("CREATE", "LLMGW_NEW", "named-x"),
                        subjects.js_api("STREAM.MSG.GET", subjects.STREAM_FLEET),
                        subjects.js_api("DIRECT.GET", subjects.STREAM_FLEET)):
            await refused(bus, subject, b"{}")
    finally:
        await bus.close()


async def read_to_end(bus: Bus, stream: str) -> int:
    """Read a stream the way every component does (ephemeral consumer, pulls, delete); how many messages."""
    last = await bus.stream_last_seq(stream)
    n = 0
    if last:
        async with asyncio.timeout(15):
            async for batch in bus.reader(stream, 1, stop_at=last, idle_expires_s=1.0).batches():
                n += len(batch)
    return n


async def test_each_role_does_its_job_with_the_api_it_is_given(secured: Secured, admin: Bus,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from llmgw.ctl import replay_state
    from llmgw.fleet import snapshots
    from llmgw.fleet.fold import encode_state
    from llmgw.fleet.replay import replay
    from llmgw.scheduler.service import Lease

    spec = m.ModelSpec(name="qwen", source="q", precision="bf16", engine="vllm", gpu_class="H100-80GB", context=4096)
    buses = {u: await secured.connect(u) for u in ("agent-h100-a-01", "router-gw-1", "projector", "planner",
                                                    "scheduler", "cli")}
    agent, router, projector, planner, scheduler, cli = buses.values()
    try:
        await agent.publish(inventory("h100-a-01"))
        await agent.publish_core(subjects.heartbeat("h100-a-01"),
                                 m.encode(m.HeartbeatSent(at=AT, node="h100-a-01", boot_id="b", seq=1)))
        await cli.publish(m.ModelDeclared(at=AT, spec=spec))
        await scheduler.publish(m.ReplicaPlaced(at=AT, replica_id="qwen-r9", model="qwen", nodes=("h100-a-01",),
                                                gpus=(m.GpuRef(node="h100-a-01", index=0, uuid="u"),), spec=spec))
        await agent.publish(m.ReplicaStateChanged(at=AT, replica_id="qwen-r9", model="qwen", node="h100-a-01",
                                                  state="healthy", endpoint="http://h100-a-01:8000"))
        await router.publish(m.IdleMapPublished(at=AT, router="gw-1", boot_id="b", tick=1))
        await cli.publish(m.ReplicaStopped(at=AT, replica_id="qwen-r9", model="qwen", reason="idle"))  # ctl idle --stop
        # Each reads what it folds: engines placements (and the node's own health); the router
        # placements; planner fleet and control; scheduler all four; projector and cli the history.
        for bus, streams in ((agent, (subjects.STREAM_CONTROL, subjects.STREAM_FLEET)),
                             (router, (subjects.STREAM_CONTROL,)),
                             (planner, (subjects.STREAM_FLEET, subjects.STREAM_CONTROL)),
                             (scheduler, [x for x in natsconf.ALL_STREAMS if x != natsconf.ENGINE_KEYS]),
                             (cli, subjects.HISTORY_STREAMS),
                             (projector, (subjects.STREAM_HEARTBEAT,))):  # GPU use for status
            for stream in streams:
                assert await read_to_end(bus, stream) >= 1, (bus, stream)
        # They check the streams at start; admin declared them (the lease is the scheduler's alone).
        await projector.ensure_streams(lease=False)
        await scheduler.ensure_streams()
        state, cursor = (c := await replay(projector, use_snapshots=False)).state, c.cursor
        assert state.nodes["h100-a-01"].gpus and cursor.unprojected == 0
        assert (await replay_state(cli)).models["qwen"].spec == spec
        # The projector writes fold snapshots; every other role reads them and none writes one.
        await snapshots.write(projector, encode_state(state, cursor), cursor, 1)
        heads = {x: await cli.stream_head(x) for x in subjects.HISTORY_STREAMS}
        target = snapshots.Target(stops={x: h[0] for x, h in heads.items()}, cut_ns={})
        for bus in (cli, scheduler, planner, router, agent):
            warned: list[str] = []
            found = await snapshots.load(bus, target, heads, warned.append)
            assert found is not None and found[0].state == state, (bus, warned)
        assert "NATS refused" not in caplog.text
        with pytest.raises(PermissionDeniedError):
            await snapshots.write(agent, encode_state(state, cursor), cursor, 2)
        caplog.clear()  # that refusal was the point
        await (await scheduler.key_value(subjects.SCHEDULER_LEASE_BUCKET, ttl_s=10)).delete("leader")  # another test's
        lease = Lease(scheduler, "sched-a", ttl_s=5)
        assert await lease.acquire() and await lease.renew()
        await lease.release()
        assert await Lease(scheduler, "sched-b", ttl_s=5).acquire()  # the released key is created again
    finally:
        for bus in buses.values():
            await bus.close()
    assert "NATS refused" not in caplog.text


async def test_only_routers_read_the_engines_keys(secured: Secured, admin: Bus) -> None:
    """Issue 45, finding 3: the key that lets a request past the router reaches routers and no other role."""
    issued = m.EngineKeyIssued(at=AT, replica_id="qwen-r7", node="h100-a-01", key="k" * 43,
                               endpoint="http://h100-a-01:8000")
    buses = {u: await secured.connect(u) for u in NON_ADMIN}
    try:
        agent = buses["agent-h100-a-01"]
        ack = await agent.publish(issued)
        assert ack.stream == subjects.STREAM_ENGINE_KEYS
        # An agent speaks for its own node's engines only; no other role issues keys.
        await denied(agent, msgspec.structs.replace(issued, node="h100-a-02"))
        for user in ("router", "cli", "scheduler"):
            await denied(buses[user], issued)
        for user in ("router", "router-gw-1"):
            assert await read_to_end(buses[user], subjects.STREAM_ENGINE_KEYS) >= 1, user
        last = subjects.js_api("DIRECT.GET", subjects.STREAM_ENGINE_KEYS, subjects.engine_key("qwen-r7", "h100-a-01"))
        for user in ("agent-h100-a-01", "projector", "planner", "scheduler", "cli", "viewer"):
            bus = buses[user]
            await refused(bus, subjects.js_consumer("CREATE", subjects.STREAM_ENGINE_KEYS, "peek"), b"{}")
            await refused(bus, last, b"")
            await refused(bus, subjects.js_api("DIRECT.GET", subjects.STREAM_ENGINE_KEYS), b'{"seq": 1}')
            await refused(bus, subjects.js_stream("MSG.GET", subjects.STREAM_ENGINE_KEYS), b'{"seq": 1}')
    finally:
        for bus in buses.values():
            await bus.close()


async def test_a_role_reads_only_its_own_inbox(secured: Secured, admin: Bus, caplog: pytest.LogCaptureFixture) -> None:
    """An agent once subscribed to _INBOX.>, read the router's consumer-create reply and deleted its consumer."""
    agent, router = await secured.connect("agent-h100-a-01"), await secured.connect("router")
    heard: list[str] = []

    async def eavesdrop(msg: Msg) -> None:
        heard.append(msg.subject)

    try:
        await agent.nc.subscribe("_INBOX.>", cb=eavesdrop)
        await agent.nc.flush()
        await admin.publish(m.ModelScaled(at=AT, name="inbox-test", replicas=1))
        assert await read_to_end(router, subjects.STREAM_CONTROL) >= 1
        await agent.nc.flush()  # anything the server sent the agent before this round trip is in
        assert heard == [], "the agent read the router's replies"
        # Not even under the router's own prefix; and its own replies still reach it.
        await agent.nc.subscribe(subjects.inbox_prefix("router") + ".>", cb=eavesdrop)
        assert router.nc.new_inbox().startswith(subjects.inbox_prefix("router") + ".")
        assert await read_to_end(router, subjects.STREAM_CONTROL) >= 1
        assert await read_to_end(agent, subjects.STREAM_CONTROL) >= 1
        await agent.nc.flush()
    finally:
        await agent.close()
        await router.close()
    assert heard == []
    assert caplog.text.lower().count("permissions violation for subscription") >= 2


async def test_agents_report_only_themselves_and_only_the_scheduler_loses_nodes(secured: Secured, admin: Bus) -> None:
    agent, sched = await secured.connect("agent-h100-a-01"), await secured.connect("scheduler")
    try:
        # Its own `.lost`/`.returned` are no longer its to say: silence is the liveness monitor's to judge.
        await denied(agent, m.NodeLost(at=AT, node="h100-a-01"))
        await denied(agent, m.NodeReturned(at=AT, node="h100-a-01"))
        await sched.publish(m.NodeLost(at=AT, node="h100-a-01"))
        await sched.publish(m.NodeReturned(at=AT, node="h100-a-01"))
    finally:
        await agent.close()
        await sched.close()


# --- password variables and the nats-conf command -----------------------------------------------


def test_node_names_that_read_alike_get_their_own_password_variables() -> None:
    nodes = ["a-b", "a_b", "A-B", "a.b"]
    names = {natsconf.password_env(natsconf.user_name("agent", n)) for n in nodes}
    assert len(names) == len(nodes)
    assert natsconf.password_env("agent-h100-a-01") == "LLMGW_PW_AGENT_H100_A_01"  # the readable ones stay
    assert all(re.fullmatch(r"LLMGW_PW_[A-Z0-9_]+", n) for n in names)
    text = natsconf.render(nodes)
    assert all(f"password: ${n}" in text for n in names)
    # A name built to read like another's hashed variable is refused, never shared.
    clash = natsconf.password_env(natsconf.user_name("agent", "a_b")).removeprefix("LLMGW_PW_AGENT_")
    with pytest.raises(ConfigError, match="would both read"):
        natsconf.render(["a_b", clash.lower().replace("_", "-")])


@pytest.mark.parametrize(("args", "message"), [
    (["--node", ""], "node name cannot be empty"),
    (["--node", "gpu-1", "--router", " "], "router name cannot be empty"),
    (["--node", "gpu-1", "-o", "/nonexistent/x.conf"], "cannot write /nonexistent/x.conf"),
    (["--node", "gpu-1", "--env-file", "/nonexistent/creds.env"], "cannot write /nonexistent/creds.env"),
])
def test_nats_conf_mistakes_are_one_error_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["nats-conf", *args])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and message in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_nats_conf_never_leaves_a_half_written_conf(tmp_path: Path) -> None:
    out = tmp_path / "nats.conf"
    out.write_text("# the operator's conf\n")
    result = CliRunner().invoke(cli, ["nats-conf", "--node", "gpu-1", "-o", str(out), "--env-file", str(tmp_path / "no" / "c.env")])
    assert result.exit_code == 1 and "cannot write" in result.output
    assert out.read_text() == "# the operator's conf\n"  # neither replaced nor truncated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nats.conf"]  # no temporary file left
    ok = CliRunner().invoke(cli, ["nats-conf", "--node", "gpu-1", "-o", str(out)])
    assert ok.exit_code == 0 and out.read_text() == natsconf.render(["gpu-1"])
