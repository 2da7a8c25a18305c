"""Placement prefers nodes whose disks hold a model's files: the pure scheduler, folded as the service folds."""

from __future__ import annotations

import random
from datetime import timedelta

import msgspec
from test_scheduler import T0, World, placed
from test_sharing import CARD_MIB, card

from llmgw import messages as m
from llmgw.fleet.files import holders, where_files_are
from llmgw.fleet.state import booking_mib

GGUF_SIZE = 2_700_000_000
NODES = [f"n{i}" for i in range(8)]
HOLDERS = ("n2", "n5")


def small(name: str, gib: float, **kw: object) -> m.ModelSpec:
    fields: dict[str, object] = {"context": 2048, "source": f"./models/{name}", **kw}
    return m.ModelSpec(name=name, precision="q8_0", engine="llama.cpp", gpu_class="L4-16GB", gib_per_gpu=gib,
                       **fields)  # type: ignore[arg-type]


def tiny(**kw: object) -> m.ModelSpec:
    return small("tiny", 3.0, **{"source": "acme/tiny-GGUF", "file": "tiny-q4_k_m.gguf", **kw})


def files_on(node: str, *held: tuple[str, str, bool]) -> m.NodeFilesReported:
    """A node's report: (source, file, complete) each."""
    return m.NodeFilesReported(at=T0, node=node, sources=tuple(
        m.HeldSource(source=src, store="models-dir", complete=ok, size=GGUF_SIZE,
                     files=(m.HeldFile(path=f, size=GGUF_SIZE, complete=ok),)) for src, f, ok in held))


def world() -> World:
    w = World(*(card(n) for n in NODES))
    for n in HOLDERS:
        w.feed(files_on(n, ("acme/tiny-GGUF", "tiny-q4_k_m.gguf", True)))
    # Beside them: another precision of the same repository, a partial download of this one, other models.
    w.feed(files_on("n0", ("acme/tiny-GGUF", "tiny-q8_0.gguf", True)))
    w.feed(files_on("n1", ("acme/tiny-GGUF", "tiny-q4_k_m.gguf", False), ("acme/other", "o.gguf", True)))
    return w


def holder_room(w: World, avoid: set[str]) -> bool:
    """Whether a holder not in ``avoid`` has a GPU with room for one tiny replica."""
    booked = w.state.booked()
    need = booking_mib(tiny(), CARD_MIB)
    return any(CARD_MIB - booked.get((n, 0), 0) >= need for n in HOLDERS if n not in avoid)


def test_holders_are_the_nodes_with_the_spec_file_complete() -> None:
    w = world()
    assert holders(w.state.files, tiny()) == set(HOLDERS)
    assert holders(w.state.files, tiny(file="tiny-q8_0.gguf")) == {"n0"}
    assert where_files_are(w.state.files, tiny()) == "files on 2 nodes (n2, n5)"
    assert where_files_are(w.state.files, tiny(source="acme/none")) == \
        "files on no node: a placement downloads them first"


def test_a_holder_comes_before_a_tighter_fit_without_the_files() -> None:
    w = world()
    w.feed(m.ModelDeclared(at=T0, spec=small("filler", 12.0, source="./filler")))
    (filler,) = placed(w.step())
    assert filler.nodes[0] not in HOLDERS  # best fit alone would put tiny beside it (the tightest card)
    w.feed(m.ModelDeclared(at=T0, spec=tiny()))
    (got,) = placed(w.step())
    assert got.nodes[0] in HOLDERS and got.reason == "0 of 1 running"


def test_200_wakes_on_8_nodes_where_2_hold_the_files_go_to_a_holder_whenever_one_has_room() -> None:
    rng = random.Random(42)
    wakes = on_holder = without_room = 0
    for i in range(200):
        w = world()
        # Other models take random room first, sometimes all of the holders'.
        for j in range(rng.randrange(0, 14)):
            w.feed(m.ModelDeclared(at=T0, spec=small(f"f{j}", rng.choice([2.0, 5.0, 9.0, 14.0]), source=f"./f{j}")))
        w.step()
        w.feed(m.ModelDeclared(at=T0, spec=tiny(replicas=0)))
        w.step()
        want = 1 if i % 2 else 2  # a wake from zero, or a wake and a scale-up beside it
        w.feed(m.ModelScaled(at=T0 + timedelta(seconds=1), name="tiny", replicas=want))
        avoid: set[str] = set()
        rooms = [holder_room(w, avoid)]
        got = placed(w.step(T0 + timedelta(seconds=1)))
        for n, e in enumerate(got):
            if n:
                rooms.append(holder_room_before(w, e, got[:n]))
            wakes += rooms[n]
            on_holder += rooms[n] and e.nodes[0] in HOLDERS
            if not rooms[n]:
                without_room += 1
                assert e.nodes[0] in HOLDERS or "downloads 2.5 GiB first" in e.reason, e.reason
    assert wakes >= 150 and without_room >= 5, (wakes, without_room)  # both cases were met
    assert on_holder / wakes >= 0.99, (on_holder, wakes)


def holder_room_before(w: World, e: m.ReplicaPlaced, earlier: list[m.ReplicaPlaced]) -> bool:
    """Whether a holder the earlier replicas of this pass were not on had room before ``e`` took its GPU."""
    booked = w.state.booked()
    for g in e.gpus:
        booked[(g.node, g.index)] -= g.mib
    need = booking_mib(tiny(), CARD_MIB)
    used = {n for p in earlier for n in p.nodes}
    return any(CARD_MIB - booked.get((n, 0), 0) >= need for n in HOLDERS if n not in used)


def test_unplaceable_says_where_the_files_are() -> None:
    w = world()
    w.feed(m.ModelDeclared(at=T0, spec=msgspec.structs.replace(tiny(), tp=2)))
    (why,) = [e for e in w.step() if isinstance(e, m.ModelUnplaceable)]
    assert why.reason.endswith("; its files are on 2 nodes (n2, n5), none with room for it")


def test_each_files_event_reads_as_one_line() -> None:
    t = T0
    assert m.describe(m.DownloadFinished(at=t, node="n1", model="tiny", source="acme/tiny-GGUF", ok=True,
                                         size=3 << 30, seconds=12.5, files=1, mismatches=1)) == (
        "node n1 fetched acme/tiny-GGUF for tiny: 1 file, 3.0 GiB in 12.5s, verified, 1 refetched after a digest mismatch")
    assert m.describe(m.DownloadProgressed(at=t, node="n1", model="tiny", source="acme/tiny-GGUF", done=1 << 30,
                                           total=4 << 30, rate=50 << 20)) == (
        "node n1 fetching acme/tiny-GGUF for tiny: 1.0 GiB of 4.0 GiB (25%) at 50.0 MiB/s")
    assert m.describe(files_on("n2", ("acme/tiny-GGUF", "t.gguf", True), ("acme/x", "x.gguf", False))) == (
        "node n2 holds 2 model sources (1 complete, 5.0 GiB)")
    assert m.describe(m.ModelPrefetchRequested(at=t, name="tiny")) == "model tiny: prefetch asked of every node"


def test_the_status_report_says_on_how_many_nodes_a_models_files_are_and_what_is_being_fetched() -> None:
    from llmgw.fleet.status import model_summaries

    w = World(*(card(n) for n in NODES))
    w.feed(m.ModelDeclared(at=T0, spec=tiny()))
    (before,) = model_summaries(w.state, T0)
    assert (before.files_nodes, before.fetching) == (-1, ())  # no node reports its disk: unknown, not none
    w = world()
    w.feed(m.ModelDeclared(at=T0, spec=tiny()))
    w.feed(m.DownloadProgressed(at=T0, node="n7", model="tiny", source="acme/tiny-GGUF", done=1 << 30,
                                total=GGUF_SIZE, rate=1e8))
    (row,) = [s for s in model_summaries(w.state, T0) if s.name == "tiny"]
    assert row.files_nodes == 2
    assert row.fetching == (m.FileFetch(node="n7", done=1 << 30, total=GGUF_SIZE, rate=1e8, at=T0),)
    w.feed(m.DownloadFinished(at=T0, node="n7", model="tiny", source="acme/tiny-GGUF", ok=True))
    (row,) = [s for s in model_summaries(w.state, T0) if s.name == "tiny"]
    assert row.fetching == ()


def test_the_ledger_times_the_download_and_tells_cached_wakes_from_fetched_ones() -> None:
    from llmgw.cli.coldstarts import summary_line
    from llmgw.fleet.history import ModelHistory
    from llmgw.fleet.status import model_detail

    w = world()
    history = ModelHistory()
    seq = 0

    def feed(e: m.Event) -> None:
        nonlocal seq
        seq += 1
        w.feed(e)
        if isinstance(e, m.ControlEvent):  # type: ignore[misc, arg-type]
            history.note(seq, e)

    spec = tiny(min_replicas=0, max_replicas=2)
    feed(m.ModelDeclared(at=T0, spec=spec))
    for i, (node, fetch_s) in enumerate([("n2", None), ("n7", 30.0), ("n5", None), ("n6", 50.0)]):
        t = T0 + timedelta(minutes=10 * i)
        rid = f"tiny-r{i + 1}"
        feed(m.ReplicaPlaced(at=t, replica_id=rid, model="tiny", nodes=(node,), gpus=(), spec=spec, cause="wake",
                             reason="woken by r1: 1 request waiting"))
        start = t + timedelta(seconds=0.1)
        if fetch_s is not None:
            feed(m.ReplicaStateChanged(at=start, replica_id=rid, model="tiny", node=node, state="starting",
                                       detail="fetching the files of acme/tiny-GGUF"))
            start += timedelta(seconds=fetch_s)
        feed(m.ReplicaStateChanged(at=start, replica_id=rid, model="tiny", node=node, state="starting"))
        feed(m.ReplicaStateChanged(at=start + timedelta(seconds=2), replica_id=rid, model="tiny", node=node,
                                   state="healthy", endpoint="http://x:1"))
    starts = history.cold_starts("tiny")
    assert [c.download_s for c in starts] == [None, 30.0, None, 50.0]
    assert [round(c.total_s or 0, 1) for c in starts] == [2.1, 32.1, 2.1, 52.1]
    detail = model_detail(w.state, T0 + timedelta(hours=1), "tiny", history)
    assert detail is not None
    assert summary_line(detail).endswith(
        " · files on the node: 2, p50 2.10s p95 2.10s · fetched first: 2, p50 32.10s p95 52.10s (download p50 30.00s)")


def test_a_placement_without_the_files_pays_the_recorded_download_rate() -> None:
    from llmgw.fleet.files import download_rate, fetch_s

    w = world()
    assert fetch_s(w.state.files, w.state.downloaded, tiny(), ["n3"]) == 0.0  # no download recorded: no figure
    for node, size, seconds in (("n2", 4 << 30, 40.0), ("n5", 2 << 30, 40.0)):
        w.feed(m.DownloadFinished(at=T0, node=node, model="x", source=f"acme/{node}", ok=True, size=size,
                                  seconds=seconds))
    w.feed(m.DownloadFinished(at=T0, node="n6", model="x", source="acme/bad", ok=False, size=1 << 40, seconds=1.0))
    assert download_rate(w.state.downloaded) == (6 << 30) / 80.0  # verified downloads only
    assert fetch_s(w.state.files, w.state.downloaded, tiny(), ["n2"]) == 0.0  # holds them
    assert fetch_s(w.state.files, w.state.downloaded, tiny(), ["n3"]) == GGUF_SIZE / ((6 << 30) / 80.0)


def test_what_if_takes_an_engines_start_up_without_the_download_and_adds_it_where_the_files_are_not() -> None:
    from llmgw.whatif.meter import StartTimes

    starts = StartTimes()
    t = T0
    spec = tiny()
    for rid, fetch in (("tiny-r1", 0.0), ("tiny-r2", 60.0)):
        starts.note(m.ReplicaPlaced(at=t, replica_id=rid, model="tiny", nodes=("n2",), gpus=(), spec=spec))
        if fetch:
            starts.note(m.ReplicaStateChanged(at=t + timedelta(seconds=0.5), replica_id=rid, model="tiny", node="n2",
                                              state="starting", detail="fetching the files of acme/tiny-GGUF"))
        starts.note(m.ReplicaStateChanged(at=t + timedelta(seconds=1 + fetch), replica_id=rid, model="tiny",
                                          node="n2", state="starting"))
        starts.note(m.ReplicaStateChanged(at=t + timedelta(seconds=3 + fetch), replica_id=rid, model="tiny",
                                          node="n2", state="healthy"))
    # r2's 60.5 s of download (fetching → its engine's own start) are not its engine's start-up.
    assert starts.samples["tiny"] == [(1.0, 3.0), (0.5, 2.5)]
