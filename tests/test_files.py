"""Weights on nodes: a real agent reports its stores, fetches from a stand-in hub, verifies, evicts.

The hub is outside the project: ``hubserver`` serves its file API on a local port, and the agent's
``huggingface_hub`` reaches it through ``HF_ENDPOINT``, as huggingface_hub's own tests do.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from hubserver import Hub, Repo, serving
from running import running, until
from streams import stored

from llmgw import messages as m
from llmgw import subjects
from llmgw.agent.downloads import FileKeeper, FilesConfig
from llmgw.agent.files import Disk, report, scan_hf_cache, scan_models_dir
from llmgw.agent.node import Agent
from llmgw.agent.runs import EngineConfig
from llmgw.agent.simnvml import SimNvml
from llmgw.agent.supervisor import EngineSupervisor
from llmgw.bus import Bus
from llmgw.config import Settings
from llmgw.engine.argv import default_commands, engine_argv
from llmgw.fleet.files import holders
from llmgw.fleet.state import fold
from llmgw.fleetfile import FleetNode, load

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GGUF = os.urandom(300_000)
SHARD = os.urandom(200_000)
REPO = "acme/tiny-GGUF"
CKPT = "acme/tiny"


def gguf_spec(name: str = "tiny", source: str = REPO, file: str = "tiny-q4_k_m.gguf") -> m.ModelSpec:
    return m.ModelSpec(name=name, source=source, precision="q4_K_M", engine="llama.cpp", gpu_class="H100-80GB",
                       context=4096, file=file, gib_per_gpu=1.0)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    repos = {REPO: Repo(files={"tiny-q4_k_m.gguf": GGUF, "tiny-q8_0.gguf": GGUF[:1000], "README.md": b"# tiny\n"}),
             CKPT: Repo(files={"config.json": b'{"model_type": "llama"}', "model.safetensors": SHARD,
                               "tokenizer.json": b"{}", "original/consolidated.pth": b"x" * 5000})}
    with serving(Hub(repos=repos)) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def keeper_for(tmp_path: Path, node: str = "h100-a-03", **kw: object) -> FileKeeper:
    cfg = FilesConfig(models_dir=tmp_path / "models", hf_cache=tmp_path / "hf",
                      **{"rescan_s": 0.2, "progress_s": 0.1, **kw})  # type: ignore[arg-type]
    return FileKeeper(node, cfg, boot_id="boot-1")


def agent_with(bus: Bus, fleet_file: Path, keeper: FileKeeper) -> Agent:
    node = load(fleet_file).node(keeper.node)
    return Agent(bus, SimNvml(node), node.name, fabric=node.fabric, simulated=True, services=[keeper])


async def files_events(bus: Bus) -> list[m.NodeFilesReported]:
    return [e for e in await stored(bus, subjects.STREAM_FLEET, limit_s=10) if isinstance(e, m.NodeFilesReported)]


# --- what a node holds ---------------------------------------------------------------------------


async def test_an_agent_reports_its_gguf_with_a_sha256_kept_beside_it(bus: Bus, fleet_file: Path, tmp_path: Path) -> None:
    folder = tmp_path / "models" / "acme__tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "tiny-q4_k_m.gguf").write_bytes(GGUF)
    (folder / "tiny-q8_0.gguf.part").write_bytes(GGUF[:100])  # a download broken off
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await until(lambda: (folder / "tiny-q4_k_m.gguf.sha256").exists(), "the GGUF's sha256 kept beside it")
        await until(lambda: bool(keeper.last and keeper.last.sources[0].files[0].digest), "a report with the digest")
        await keeper.outbox.flush()  # type: ignore[union-attr]
    want = hashlib.sha256(GGUF).hexdigest()
    assert (folder / "tiny-q4_k_m.gguf.sha256").read_text() == f"{want}  tiny-q4_k_m.gguf\n"
    reports = await files_events(bus)
    first, last = reports[0], reports[-1]
    assert first.sources[0].files[0].digest == ""  # reported at once; hashed after, once
    (held,) = last.sources
    assert (held.source, held.store, held.complete) == (REPO, "models-dir", False)
    assert [(f.path, f.size, f.digest, f.complete) for f in held.files] == [
        ("tiny-q4_k_m.gguf", len(GGUF), f"sha256:{want}", True), ("tiny-q8_0.gguf", 100, "", False)]
    state = fold(await stored(bus, subjects.STREAM_FLEET, limit_s=10))
    assert holders(state.files, gguf_spec()) == {"h100-a-03"}  # its file is there, complete
    assert holders(state.files, gguf_spec(file="tiny-q8_0.gguf")) == set()  # partial: not held
    # A second scan trusts the kept digest (newer than the file) and hashes nothing again.
    mtime = (folder / "tiny-q4_k_m.gguf.sha256").stat().st_mtime_ns
    assert scan_models_dir(tmp_path / "models")[0].files[0].digest == f"sha256:{want}"
    assert (folder / "tiny-q4_k_m.gguf.sha256").stat().st_mtime_ns == mtime


async def test_the_hf_cache_is_reported_with_blob_digests(hub: Hub, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    await asyncio.to_thread(snapshot_download, CKPT, cache_dir=tmp_path / "hf", endpoint=hub.url,
                            allow_patterns=["*.json", "*.safetensors"])
    (held,) = scan_hf_cache(tmp_path / "hf")
    assert (held.source, held.store, held.revision, held.complete) == (CKPT, "hf-cache", hub.repos[CKPT].commit, True)
    digests = {f.path: f.digest for f in held.files}
    assert digests["model.safetensors"] == f"sha256:{hashlib.sha256(SHARD).hexdigest()}"
    assert digests["config.json"].startswith("git-sha1:")
    spec = m.ModelSpec(name="tiny-vllm", source=CKPT, precision="bf16", engine="vllm", gpu_class="H100-80GB", context=4096)
    ev = report("n1", "b", [held], Disk(budget=1 << 40, free=1 << 30), T0)
    assert holders(fold([ev]).files, spec) == {"n1"}


def test_a_report_is_bounded_at_decode_and_the_agent_keeps_within_it() -> None:
    many = [m.HeldSource(source=f"org/m{i}", store="models-dir", size=1, last_used=datetime(2026, 1, 1 + i % 28, tzinfo=UTC),
                         files=(m.HeldFile(path="w.gguf", size=1),)) for i in range(m.MAX_HELD_SOURCES + 40)]
    too_many = m.NodeFilesReported(at=T0, node="n1", sources=tuple(many))
    with pytest.raises(msgspec.ValidationError, match="length"):
        m.FLEET_DECODER.decode(m.encode(too_many))
    ev = report("n1", "b", many, Disk(budget=0, free=0), T0)
    assert ev.truncated and len(ev.sources) == m.MAX_HELD_SOURCES
    assert m.FLEET_DECODER.decode(m.encode(ev)) == ev
    assert min(s.last_used for s in ev.sources if s.last_used) >= max(  # the most recently used are kept
        s.last_used for s in many if s not in ev.sources and s.last_used)
    shards = m.HeldSource(source="org/big", store="hf-cache", files=tuple(
        m.HeldFile(path=f"f{i:04d}.json" if i % 2 else f"model-{i:05d}.safetensors", size=i) for i in range(400)))
    (big,) = report("n1", "b", [shards], Disk(budget=0, free=0), T0).sources
    assert len(big.files) == m.MAX_HELD_FILES and all(f.path.endswith(".safetensors") for f in big.files)
    bad = m.encode(m.NodeFilesReported(at=T0, node="n1", sources=(m.HeldSource(
        source="x", store="hf-cache", files=(m.HeldFile(path="a", size=1, digest="md5:abc"),)),)))
    with pytest.raises(msgspec.ValidationError):
        m.FLEET_DECODER.decode(bad)


# --- fetching: prefetch, progress, digests, resume -------------------------------------------------


async def prefetch(bus: Bus, spec: m.ModelSpec, nodes: tuple[str, ...] = ()) -> None:
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
    await bus.publish(m.ModelPrefetchRequested(at=m.utcnow(), name=spec.name, nodes=nodes))


async def finished(bus: Bus, n: int = 1) -> list[m.DownloadFinished]:
    out: list[m.DownloadFinished] = []

    async def enough() -> bool:
        nonlocal out
        out = [e for e in await stored(bus, subjects.STREAM_FLEET, limit_s=10) if isinstance(e, m.DownloadFinished)]
        return len(out) >= n

    await until(enough, f"{n} finished download(s)", limit_s=60, every_s=0.2)
    return out


async def test_a_prefetch_fetches_one_gguf_reports_progress_and_verifies_it(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    # huggingface_hub writes in 10 MiB chunks, so progress read from the disk moves by 10 MiB: 24 MiB at
    # 16 MiB a second shows it moving.
    data = os.urandom(24 << 20)
    hub.repos[REPO].files["tiny-q4_k_m.gguf"] = data
    hub.rate = 16 << 20
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, gguf_spec(), nodes=("h100-a-03",))
        (done,) = await finished(bus)
        await until(lambda: keeper.holds(gguf_spec()), "the keeper's own view")
        await keeper.outbox.flush()  # type: ignore[union-attr]
    assert (done.ok, done.code, done.size, done.files, done.mismatches, done.model) == (
        True, "verified", len(data), 1, 0, "tiny")
    path = tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf"
    assert path.read_bytes() == data
    assert (tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q8_0.gguf").exists() is False  # one precision only
    assert path.with_name(path.name + ".sha256").read_text().split()[0] == hashlib.sha256(data).hexdigest()
    events = await stored(bus, subjects.STREAM_FLEET, limit_s=10)
    progress = [e for e in events if isinstance(e, m.DownloadProgressed)]
    assert progress and all(p.total == len(data) and 0 <= p.done <= p.total for p in progress)
    assert [p.done for p in progress] == sorted(p.done for p in progress)
    assert any(0 < p.done < p.total and p.rate > 0 for p in progress), progress
    state = fold(events)
    assert holders(state.files, gguf_spec()) == {"h100-a-03"}
    assert state.downloads == {} and state.downloaded["h100-a-03"][REPO].ok
    assert hub.served == ["GET acme/tiny-GGUF/tiny-q4_k_m.gguf 0"]


async def test_a_corrupted_byte_is_caught_deleted_and_fetched_again(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    hub.corrupt = 1
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, gguf_spec())
        (done,) = await finished(bus)
    assert (done.ok, done.code, done.mismatches) == (True, "verified", 1)
    assert (tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf").read_bytes() == GGUF
    assert hub.served == ["GET acme/tiny-GGUF/tiny-q4_k_m.gguf 0"] * 2


async def test_a_file_that_keeps_disagreeing_is_refused_and_never_left_to_serve(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    hub.corrupt = 99
    keeper = keeper_for(tmp_path, attempts=2)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, gguf_spec())
        (done,) = await finished(bus)
        assert await keeper.ready(gguf_spec()) is not None  # an engine would not start
    assert (done.ok, done.code, done.mismatches) == (False, "mismatch", 2)
    assert "did not match the hub's digest 2 times" in done.reason
    assert not (tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf").exists()


async def test_a_download_broken_off_resumes_where_it_stopped(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    # huggingface_hub writes what it received in 10 MiB chunks: a break after 15 MiB leaves 10 on disk.
    big = os.urandom(24 << 20)
    hub.repos["acme/big-GGUF"] = Repo(files={"big-q4_k_m.gguf": big})
    hub.cut_after = 15 << 20
    spec = gguf_spec(name="big", source="acme/big-GGUF", file="big-q4_k_m.gguf")
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, spec)
        (done,) = await finished(bus)
    assert done.ok, done.reason
    assert (tmp_path / "models" / "acme__big-GGUF" / "big-q4_k_m.gguf").read_bytes() == big
    assert hub.served == ["GET acme/big-GGUF/big-q4_k_m.gguf 0", f"GET acme/big-GGUF/big-q4_k_m.gguf {10 << 20}"]


async def test_a_checkpoint_is_fetched_into_the_hf_cache_without_other_formats(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    spec = m.ModelSpec(name="tiny-vllm", source=CKPT, precision="bf16", engine="vllm", gpu_class="H100-80GB",
                       context=4096)
    hub.corrupt = 1  # the first body served (config.json: a small file, its git sha1 disagrees)
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, spec)
        (done,) = await finished(bus)
        await keeper.outbox.flush()  # type: ignore[union-attr]
    assert done.ok and done.mismatches == 1 and done.files == 3, done
    assert sorted(s.rsplit("/", 1)[-1].split()[0] for s in hub.served) == ["config.json", "config.json",
                                                                           "model.safetensors", "tokenizer.json"]
    snapshot = tmp_path / "hf" / "models--acme--tiny" / "snapshots" / hub.repos[CKPT].commit
    assert (snapshot / "config.json").read_bytes() == hub.repos[CKPT].files["config.json"]
    assert (snapshot / "model.safetensors").read_bytes() == SHARD
    (held,) = scan_hf_cache(tmp_path / "hf")
    assert held.complete and {f.path for f in held.files} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert holders(fold(await stored(bus, subjects.STREAM_FLEET, limit_s=10)).files, spec) == {"h100-a-03"}


async def test_a_prefetch_for_other_nodes_fetches_nothing_here(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, gguf_spec(), nodes=("h100-a-01",))
        await prefetch(bus, gguf_spec(name="other", file="tiny-q8_0.gguf"), nodes=("h100-a-03",))
        (done,) = await finished(bus)
    assert done.model == "other" and hub.served == ["GET acme/tiny-GGUF/tiny-q8_0.gguf 0"]


# --- an engine starts only on complete, verified files ----------------------------------------------


def placement(node: str, spec: m.ModelSpec, rid: str = "tiny-r1") -> m.ReplicaPlaced:
    ref = m.GpuRef(node=node, index=0, uuid=load_node(node).gpu_uuid(0), mib=1024)
    return m.ReplicaPlaced(at=m.utcnow(), replica_id=rid, model=spec.name, nodes=(node,), gpus=(ref,), spec=spec)


def load_node(name: str) -> FleetNode:
    return load(Path(__file__).parent.parent / "examples" / "fleet.toml").node(name)


async def replica_states(bus: Bus, rid: str) -> list[m.ReplicaStateChanged]:
    return [e for e in await stored(bus, subjects.STREAM_CONTROL, limit_s=10)
            if isinstance(e, m.ReplicaStateChanged) and e.replica_id == rid]


def engines_with(keeper: FileKeeper, **kw: object) -> EngineSupervisor:
    sup = EngineSupervisor(keeper.node, EngineConfig(models_dir=keeper.config.models_dir, **kw))  # type: ignore[arg-type]
    sup.files_ready, sup.files_held = keeper.ready, keeper.holds
    return sup


async def test_a_replica_placed_without_its_files_fetches_them_before_its_engine_starts(
        bus: Bus, hub: Hub, tmp_path: Path) -> None:
    hub.rate, hub.corrupt = 1_000_000, 1
    keeper = keeper_for(tmp_path)
    sup = engines_with(keeper, simulate=True)
    agent = Agent(bus, SimNvml(load_node(keeper.node)), keeper.node, simulated=True, services=[sup, keeper])
    spec = gguf_spec()
    async with running(agent):
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await bus.publish(placement(keeper.node, spec))
        await until(lambda: sup.runs.get("tiny-r1") is not None and sup.runs["tiny-r1"].state == "healthy",
                    "the engine healthy", limit_s=30)
    (done,) = await finished(bus)
    states = await replica_states(bus, "tiny-r1")
    assert states[0].state == "starting" and states[0].detail == f"fetching the files of {REPO}"
    healthy = next(s for s in states if s.state == "healthy")
    # The engine's own start came after the verified download: nothing started on a partial or wrong file.
    started = [s for s in states if s.state == "starting" and s.detail != states[0].detail]
    assert done.ok and done.mismatches == 1 and done.at <= started[0].at <= healthy.at
    local = tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf"
    assert local.read_bytes() == GGUF
    # A llama.cpp engine is pointed at that file (``-m``), never at the hub.
    argv = engine_argv(spec, 8080, "127.0.0.1", default_commands(), simulate=False, models_dir=keeper.config.models_dir)
    assert argv[argv.index("-m") + 1] == str(local)


async def test_files_that_never_verify_fail_the_replica_and_start_no_engine(
        bus: Bus, hub: Hub, tmp_path: Path) -> None:
    hub.corrupt = 99
    keeper = keeper_for(tmp_path, attempts=2)
    sup = engines_with(keeper, simulate=True)
    agent = Agent(bus, SimNvml(load_node(keeper.node)), keeper.node, simulated=True, services=[sup, keeper])
    spec = gguf_spec()
    async with running(agent):
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await bus.publish(placement(keeper.node, spec))
        await until(lambda: sup.runs.get("tiny-r1") is not None and sup.runs["tiny-r1"].state == "failed",
                    "the replica failed", limit_s=30)
        assert sup.runs["tiny-r1"].proc is None  # no engine was started
    states = await replica_states(bus, "tiny-r1")
    assert [s.state for s in states] == ["starting", "failed"]
    assert states[1].detail.startswith(f"files of {REPO} not fetched (mismatch): tiny-q4_k_m.gguf of {REPO} did not "
                                       "match the hub's digest 2 times")


@pytest.mark.slow
async def test_a_real_llama_server_serves_the_gguf_its_agent_fetched(bus: Bus, hub: Hub, tmp_path: Path) -> None:
    from llama import llama_server_binary

    from llmgw.engine.demomodel import write_demo_model

    binary = llama_server_binary()
    demo = write_demo_model(tmp_path / "demo", context=2048)
    hub.repos["acme/demo-GGUF"] = Repo(files={demo.weights.name: demo.weights.read_bytes()})
    hub.rate = 2_000_000
    spec = m.ModelSpec(name="demo", source="acme/demo-GGUF", precision="q8_0", engine="llama.cpp",
                       gpu_class="H100-80GB", context=512, file=demo.weights.name, gib_per_gpu=1.0)
    keeper = keeper_for(tmp_path)
    cmds = dict(default_commands(), **{"llama.cpp": [str(binary), "-t", "1"]})
    sup = engines_with(keeper, cmds=cmds, cpu=True, host="127.0.0.1", health_timeout_s=60)
    agent = Agent(bus, SimNvml(load_node(keeper.node)), keeper.node, simulated=True, services=[sup, keeper])
    async with running(agent):
        await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
        await bus.publish(placement(keeper.node, spec, rid="demo-r1"))
        await until(lambda: sup.runs.get("demo-r1") is not None and sup.runs["demo-r1"].state == "healthy",
                    "llama-server healthy on the fetched file", limit_s=90)
        argv = sup.runs["demo-r1"].tail[0]
    local = tmp_path / "models" / "acme__demo-GGUF" / demo.weights.name
    assert f"-m {local}" in argv and local.read_bytes() == demo.weights.read_bytes()
    (done,) = await finished(bus)
    assert done.ok and done.code == "verified"


async def test_making_room_evicts_the_least_recently_used_and_says_so(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    for name, age_s in (("acme__old-GGUF", 7200), ("acme__newer-GGUF", 60)):
        folder = tmp_path / "models" / name
        folder.mkdir(parents=True)
        (folder / "w.gguf").write_bytes(os.urandom(200_000))
        then = datetime.now(UTC).timestamp() - age_s
        os.utime(folder / "w.gguf", (then, then))
    keeper = keeper_for(tmp_path, cache_max_bytes=len(GGUF) + 250_000)  # room for the new one and one of the two
    async with running(agent_with(bus, fleet_file, keeper)):
        await prefetch(bus, gguf_spec())
        (done,) = await finished(bus)
        await keeper.outbox.flush()  # type: ignore[union-attr]
    assert done.ok, done.reason
    events = await stored(bus, subjects.STREAM_FLEET, limit_s=10)
    (evicted,) = [e for e in events if isinstance(e, m.FilesEvicted)]
    assert (evicted.node, evicted.source, evicted.store, evicted.size) == ("h100-a-03", "acme/old-GGUF", "models-dir", 200_000)
    assert not (tmp_path / "models" / "acme__old-GGUF").exists() and (tmp_path / "models" / "acme__newer-GGUF").exists()
    state = fold(events)
    assert set(state.files["h100-a-03"].sources) == {REPO, "acme/newer-GGUF"}


async def test_a_prefetch_from_before_the_agent_started_is_done_unless_an_eviction_came_after_it(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    await prefetch(bus, gguf_spec())  # stored while no agent ran
    async with running(agent_with(bus, fleet_file, keeper_for(tmp_path))):
        (done,) = await finished(bus)
    assert done.ok and len(hub.served) == 1
    # Evicted since (by this node's agent, which records it): the old request is not the latest word.
    folder = tmp_path / "models" / "acme__tiny-GGUF"
    for f in folder.glob("tiny-q4_k_m.gguf*"):
        f.unlink()
    state = tmp_path / "models" / ".llmgw-files.json"
    state.write_text(json.dumps({"used": {}, "evicted": {REPO: datetime.now(UTC).isoformat()}}))
    keeper = keeper_for(tmp_path)
    async with running(agent_with(bus, fleet_file, keeper)):
        await until(lambda: keeper.caught_up.is_set(), "the keeper caught up with the control stream")
        assert keeper._prefetch.empty() and not keeper._fetching  # the old request was not queued
        await asyncio.sleep(0.5)  # and nothing was fetched a moment later either
    assert len(hub.served) == 1 and len(await finished(bus)) == 1


async def test_files_deleted_behind_the_agents_back_are_fetched_again_not_trusted(
        bus: Bus, hub: Hub, fleet_file: Path, tmp_path: Path) -> None:
    keeper = keeper_for(tmp_path, rescan_s=3600)  # no rescan comes to the rescue
    async with running(agent_with(bus, fleet_file, keeper)):
        assert await keeper.ready(gguf_spec()) is None and keeper.holds(gguf_spec())
        (tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf").unlink()
        assert not keeper.holds(gguf_spec())
        assert await keeper.ready(gguf_spec()) is None
    assert (tmp_path / "models" / "acme__tiny-GGUF" / "tiny-q4_k_m.gguf").read_bytes() == GGUF
    assert len(hub.served) == 2


async def test_the_scheduler_places_on_the_node_holding_the_files_and_the_next_replica_fetches_them(
        bus: Bus, settings: Settings, hub: Hub, tmp_path: Path) -> None:
    from llmgw.scheduler.service import SchedulerService

    spec = msgspec.structs.replace(gguf_spec(), replicas=1)
    held = tmp_path / "h100-a-02" / "models" / "acme__tiny-GGUF"
    held.mkdir(parents=True)
    (held / "tiny-q4_k_m.gguf").write_bytes(GGUF)
    agents, sups = [], {}
    for name in ("h100-a-01", "h100-a-02"):  # best fit alone takes h100-a-01 (the tie goes by name)
        keeper = keeper_for(tmp_path / name, node=name)
        sups[name] = engines_with(keeper, simulate=True)
        agents.append(Agent(bus, SimNvml(load_node(name)), name, simulated=True, services=[sups[name], keeper]))
    sched_bus = await Bus.connect(settings, "sched")
    sched = SchedulerService(sched_bus, tick_s=0.1)
    stop = asyncio.Event()
    async with running(agents[0]), running(agents[1]):

        async def both_reported() -> bool:
            return {e.node for e in await files_events(bus)} == {"h100-a-01", "h100-a-02"}

        await until(both_reported, "both nodes' file reports stored before the scheduler folds")
        task = asyncio.create_task(sched.run(stop))
        try:
            await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=spec))
            await until(lambda: "tiny-r1" in sups["h100-a-02"].runs and sups["h100-a-02"].runs["tiny-r1"].state == "healthy",
                        "tiny-r1 healthy on the node holding its file", limit_s=30)
            await bus.publish(m.ModelScaled(at=m.utcnow(), name="tiny", replicas=2))
            await until(lambda: "tiny-r2" in sups["h100-a-01"].runs and sups["h100-a-01"].runs["tiny-r2"].state == "healthy",
                        "tiny-r2 healthy on the other node, after fetching", limit_s=30)
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
            await sched_bus.close()
    placed = {e.replica_id: e for e in await stored(bus, subjects.STREAM_CONTROL, limit_s=10)
              if isinstance(e, m.ReplicaPlaced)}
    assert placed["tiny-r1"].nodes == ("h100-a-02",) and "downloads" not in placed["tiny-r1"].reason
    assert placed["tiny-r2"].nodes == ("h100-a-01",)
    assert placed["tiny-r2"].reason.endswith("its files are only on h100-a-02 (each already serves it): downloads 293.0 KiB first")
    assert hub.served == ["GET acme/tiny-GGUF/tiny-q4_k_m.gguf 0"]  # only the second replica's node fetched
