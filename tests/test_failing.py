"""A model whose engines keep failing to start reads ``failing`` with its last error line (issue 43 #4):
``ctl status``, ``ctl model list`` and ``ctl model show``, live and replayed, through a restart loop and
a re-placement."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from live_projector import publish_fresh, serving
from projection_events import inventory, placed, t
from test_cli_models import FLEET, control, invoke

from llmgw import messages as m
from llmgw.bus import Bus
from llmgw.cli.main import cli
from llmgw.config import Settings
from llmgw.engine.demomodel import write_demo_model
from llmgw.fleet.history import error_line

TINY = m.ModelSpec(name="tiny", source="org/tiny", precision="q8_0", engine="llama.cpp", gpu_class="L40S-48GB",
                   context=1024, file="nothere.gguf", gib_per_gpu=1.0)
# What llama-server 0.3.36 prints for a GGUF that is not there (its lines, as the agent joins them).
LINES = ("0.00.004.317 I srv    load_model: loading model 'nothere.gguf' | 0.00.004.456 E gguf_init_from_file: "
         "failed to open GGUF file 'nothere.gguf' (No such file or directory) | 0.00.004.699 E llama_model_load: "
         "error loading model: llama_model_loader: failed to load model from nothere.gguf | 0.00.005.257 E srv  "
         "llama_server: exiting due to model loading error")
WHY = "gguf_init_from_file: failed to open GGUF file 'nothere.gguf' (No such file or directory)"


def crash_loop() -> list[m.Event]:
    def said(rid: str, minute: float, state: str, restarts: int, detail: str) -> m.ReplicaStateChanged:
        return m.ReplicaStateChanged(at=t(minute), replica_id=rid, model="tiny", node="n4", state=state,
                                     restarts=restarts, detail=detail)

    return [
        inventory("n4", "pcie", 2, t(0), gpu_class="L40S-48GB"),
        m.ModelDeclared(at=t(1), spec=TINY),
        placed("tiny-r1", TINY, [("n4", 0)], t(2), fabric="pcie"),
        said("tiny-r1", 2.1, "starting", 0, ""),
        *[e for n in (1, 2, 3) for e in (
            said("tiny-r1", 2 + n / 4, "unhealthy", n, f"engine exited (0); restart {n} of 3 in {2 ** (n - 1)}s: {LINES}"),
            said("tiny-r1", 2 + n / 4 + 0.1, "starting", n, f"restart {n}"))],
        said("tiny-r1", 3.5, "failed", 3, f"engine exited (0) after 3 restarts: {LINES}"),
        m.ReplicaStopped(at=t(3.6), replica_id="tiny-r1", model="tiny", code="failed",
                         reason="re-placing: its engine failed"),
        placed("tiny-r2", TINY, [("n4", 1)], t(3.7), fabric="pcie"),
        said("tiny-r2", 3.8, "starting", 0, ""),  # re-placed: it has not failed yet itself
    ]


EVENTS = crash_loop()


@pytest.fixture
def live(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    asyncio.run(publish_fresh(settings, EVENTS))
    with serving(settings, tmp_path / "live.duckdb", len(EVENTS)):
        yield settings


def ctl(settings: Settings, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["ctl", *args, "--nats-url", settings.nats_url])
    return r.exit_code, r.output


def test_the_error_line_is_the_cause_not_the_exit() -> None:
    assert error_line(f"engine exited (0); restart 1 of 3 in 1s: {LINES}") == WHY
    assert error_line(f"n4: engine exited (1) after 3 restarts: {LINES}") == WHY
    # vLLM: a traceback says what went wrong on its last line.
    assert error_line("engine exited (1); restart 1 of 3 in 1s: Traceback (most recent call last): | "
                      "  File \"x.py\", line 1 | torch.OutOfMemoryError: CUDA out of memory") == \
        "torch.OutOfMemoryError: CUDA out of memory"
    assert error_line("(no output)") == "(no output)"


@pytest.mark.parametrize("replay", [False, True])
def test_a_crash_looping_model_reads_failing_with_its_reason(live: Settings, replay: bool) -> None:
    more = ("--replay",) if replay else ()
    code, out = ctl(live, "model", "list", "--json", *more)
    assert code == 0, out
    (row,) = json.loads(out)
    assert (row["state"], row["failure"], row["failure_at"]) == ("failing", WHY, "2026-03-02T10:03:30Z")

    code, table = ctl(live, "model", "list", *more)
    assert code == 0, table
    assert "  tiny    failing " in table, table
    assert f"tiny: its engine fails to start: {WHY}" in table

    code, show = ctl(live, "model", "show", "tiny", *more)
    assert code == 0, show
    assert show.startswith("tiny: failing · 0/1 healthy"), show
    assert f"  why         its engine fails to start: {WHY} (since 2026-03-02 10:03:30)\n" in show, show

    code, status = ctl(live, "status", *more)
    assert code == 0, status
    assert "models: 1 failing (tiny)" in status, status
    assert "Failing models" in status and "failed to open GGUF file" in status
    code, js = ctl(live, "status", "--json", *more)
    assert json.loads(js)["model_states"] == {"tiny": "failing"}


def test_a_healthy_replica_ends_failing(settings: Settings, tmp_path: Path) -> None:
    healthy = m.ReplicaStateChanged(at=t(5), replica_id="tiny-r2", model="tiny", node="n4", state="healthy",
                                    endpoint="http://n4:8001")
    asyncio.run(publish_fresh(settings, [*EVENTS, healthy]))
    code, out = ctl(settings, "model", "list", "--json", "--replay")
    assert code == 0, out
    (row,) = json.loads(out)
    assert (row["state"], row["failure"]) == ("serving", None)


async def test_deploy_file_that_its_model_directory_lacks_is_refused(bus: Bus, nats_url: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``deploy --file nothere.gguf`` was accepted, and its engines then crash-looped."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    made = write_demo_model(tmp_path / "tiny")
    args = ["ctl", "model", "deploy", "tiny", str(made.gguf.parent), "--from-plan", "--fleet", str(FLEET),
            "--precision", "q8_0", "--context", "1024"]
    r = await invoke(nats_url, *args, "--file", "nothere.gguf")
    assert r.exit_code == 1, r.output
    assert r.output == (f"Error: --file nothere.gguf: no such file in {made.gguf.parent} (GGUF files there: "
                        f"{made.gguf.name}); give one of those, or a path to the GGUF\n")
    assert await control(bus) == []
    ok = await invoke(nats_url, *args, "--file", made.gguf.name)
    assert ok.exit_code == 0, ok.output
    assert len(await control(bus)) == 1


def test_model_show_keeps_each_replica_on_its_line_at_220_columns(settings: Settings) -> None:
    """The replica table folded the endpoint URL and GPU UUID over four lines at COLUMNS=220: the state
    column carried the engine's whole joined output."""
    uuid = "GPU-c3081f2a-5d6e-7b8c-9d0e-1f2a3b4c5d6e"
    events = [*EVENTS[:2],
              m.ReplicaPlaced(at=t(2), replica_id="tiny-r1", model="tiny", nodes=("n4",), fabric="pcie", spec=TINY,
                              gpus=(m.GpuRef(node="n4", index=0, uuid=uuid),)),
              m.ReplicaStateChanged(at=t(3), replica_id="tiny-r1", model="tiny", node="n4", state="unhealthy",
                                    restarts=1, endpoint="http://127.0.0.1:41234",
                                    detail=f"engine exited (0); restart 1 of 3 in 1s: {LINES}")]
    asyncio.run(publish_fresh(settings, events))
    r = CliRunner(env={"COLUMNS": "220"}).invoke(cli, ["ctl", "model", "show", "tiny", "--replay",
                                                       "--nats-url", settings.nats_url])
    assert r.exit_code == 0, r.output
    (row,) = [x for x in r.output.splitlines() if x.split()[:2] == ["tiny-r1", "unhealthy"]]
    assert f"n4:0 {uuid}" in row and "http://127.0.0.1:41234" in row, r.output
    assert max(len(x) for x in r.output.splitlines()) <= 220
    # The engine's lines are all there, below the table, not folded into it.
    table = r.output[:r.output.index("\nEvents (")]
    assert "\n  tiny-r1 unhealthy: engine exited (0); restart 1 of 3 in 1s: " in table
    assert "failed to open GGUF file 'nothere.gguf' (No such file or directory)" in " ".join(
        x.strip() for x in table.splitlines())
