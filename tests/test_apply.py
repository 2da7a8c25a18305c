"""Declarative deploys: the same declaration twice is one, a change says what changed, a bad file publishes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from test_cli_models import FLEET, MODELS, QWEN, control, deploy_args, invoke

from llmgw import messages as m
from llmgw.bus import Bus

ROOT = Path(__file__).resolve().parent.parent

ENTRY = """
[[model]]
name = "qwen14"
model = "Qwen/Qwen2.5-14B-Instruct"
precision = "bf16"
tp = 1
gpu_class = "H100-80GB"
context = {context}
idle_ttl = "2h"

[[model]]
name = "coder"
model = "Qwen/Qwen2.5-Coder-32B-Instruct"
candidate = 1
context = 16384
min_replicas = 0
max_replicas = 2
"""


def apply_args(path: Path, *extra: str) -> list[str]:
    return ["apply", str(path), "--fleet", str(FLEET), "--models-dir", str(MODELS), *extra]


async def test_applying_a_file_twice_declares_once_and_a_change_says_what_changed(bus: Bus, nats_url: str,
                                                                                  tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text(ENTRY.format(context=16384))
    first = await invoke(nats_url, *apply_args(f))
    assert first.exit_code == 0, first.output
    assert "declared qwen14:" in first.output and "declared coder:" in first.output
    declared = [e for e in await control(bus) if isinstance(e, m.ModelDeclared)]
    assert {e.spec.name for e in declared} == {"qwen14", "coder"}
    assert next(e.spec for e in declared if e.spec.name == "qwen14").idle_ttl_s == 7200

    again = await invoke(nats_url, *apply_args(f))
    assert again.exit_code == 0, again.output
    assert "unchanged qwen14" in again.output and "unchanged coder" in again.output
    assert "0 declared or changed, 2 unchanged" in again.output
    assert len(await control(bus)) == 2  # nothing published

    f.write_text(ENTRY.format(context=8192))
    changed = await invoke(nats_url, *apply_args(f, "--json"))
    assert changed.exit_code == 0, changed.output
    rows = {r["declared"]["name"]: r for r in json.loads(changed.output)}
    assert rows["coder"]["unchanged"] and not rows["qwen14"]["unchanged"]
    assert "context 16,384 → 8,192" in rows["qwen14"]["changes"]
    assert len(await control(bus)) == 3


async def test_the_same_deploy_twice_restarts_nothing_even_when_the_plan_moved(bus: Bus, nats_url: str) -> None:
    """The plan's derived figures (calibrated since) do not make a re-run a change: pinned as declared."""
    args = deploy_args("--candidate", "1", "--context", "16384")
    assert (await invoke(nats_url, *args)).exit_code == 0
    (first,) = await control(bus)
    assert isinstance(first, m.ModelDeclared)
    # As if it had been declared from an older calibration: other figures, same inputs.
    older = msgspec.structs.replace(first.spec, gib_per_gpu=first.spec.gib_per_gpu + 0.15,
                                    kv_tokens=first.spec.kv_tokens + 608)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=older))
    again = await invoke(nats_url, *args)
    assert again.exit_code == 0, again.output
    assert again.output.startswith("unchanged qwen: declared as asked already; nothing published\n")
    assert "the plan's figures moved since (gib_per_gpu" in again.output and "kv_tokens" in again.output
    assert len(await control(bus)) == 2
    replanned = await invoke(nats_url, *args, "--replan")
    assert replanned.output.startswith("replanned qwen: gib_per_gpu") and len(await control(bus)) == 3
    scaled_only = await invoke(nats_url, *deploy_args("--candidate", "1", "--context", "16384", "--replicas", "2"))
    assert "changed qwen: replicas 1 → 2" in scaled_only.output
    assert "its replicas keep running" in scaled_only.output


@pytest.mark.parametrize(("text", "words"), [
    ('[[model]]\nname = "a"\nmodel = "x"\ncontxt = 4', "contxt"),
    ('[[model]]\nname = "a"\nmodel = "x"\ncontext = "big"', "Expected `int | null`, got `str`"),
    ('[[model]]\nname = "a"\nmodel = "Qwen/Qwen2.5-14B-Instruct"\ncontext = 4096\n'
     '[[model]]\nname = "a"\nmodel = "Qwen/Qwen2.5-14B-Instruct"\ncontext = 4096', "a second entry named 'a'"),
    ('[[model]]\nname = "a"\nmodel = "Qwen/Qwen2.5-14B-Instruct"\nidle_ttl = "soon"', "idle_ttl"),
    ('[models]\nname = "a"', "unknown top-level key(s) models"),
    # Issue 45: a name deploy refuses is refused here too (no reader could decode it), and so is one
    # that is not text; TOML nested past what the parser recurses is an error, not a traceback.
    ('[[model]]\nname = "../../etc"\nmodel = "Qwen/Qwen2.5-14B-Instruct"', "name must be 1 to 128 letters"),
    ('[[model]]\nname = "a b"\nmodel = "Qwen/Qwen2.5-14B-Instruct"', "(got 'a b')"),
    ('[[model]]\nname = "' + "n" * 5000 + '"\nmodel = "Qwen/Qwen2.5-14B-Instruct"', "(5,000 characters)"),
    ("x = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
    ("[[model]]\nname = \"a\"\nengine_args = " + "{a=" * 3000 + "1" + "}" * 3000, "nested too deeply"),
    ("[[model]\n", "not valid TOML"),
    ('[[model]]\nname = "ok"\nmodel = "Qwen/Qwen2.5-14B-Instruct"\ncontext = 4096\n'
     '[[model]]\nname = "huge"\nmodel = "deepseek-ai/DeepSeek-V3"\ncandidate = 1\ngpu_class = "H100-80GB"',
     "model 'huge': --candidate already names the GPU class; give one or the other; nothing was applied"),
])
async def test_a_bad_file_is_one_error_and_publishes_nothing(bus: Bus, nats_url: str, tmp_path: Path,
                                                             text: str, words: str) -> None:
    f = tmp_path / "models.toml"
    f.write_text(text)
    r = await invoke(nats_url, *apply_args(f))
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], r.output
    assert await control(bus) == []


async def test_the_example_declarations_apply(bus: Bus, nats_url: str) -> None:
    r = await invoke(nats_url, *apply_args(ROOT / "examples" / "models.toml"))
    assert r.exit_code == 0, r.output
    assert {e.spec.name for e in await control(bus) if isinstance(e, m.ModelDeclared)} == {"qwen14", "coder"}
    assert QWEN in r.output


async def test_a_change_to_only_the_autoscaling_knobs_keeps_the_declared_figures_and_restarts_nothing(
        bus: Bus, nats_url: str) -> None:
    """Issue 43 #2: min/max replicas alone republished the re-planned figures, which rolled the replicas
    and ratcheted kv_tokens down a few per cent per change."""
    args = deploy_args("--candidate", "1", "--context", "16384")
    assert (await invoke(nats_url, *args)).exit_code == 0
    (first,) = await control(bus)
    assert isinstance(first, m.ModelDeclared)
    older = msgspec.structs.replace(first.spec, gib_per_gpu=first.spec.gib_per_gpu + 0.15,
                                    kv_tokens=first.spec.kv_tokens + 608)
    await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=older))
    knobs = await invoke(nats_url, *args, "--min-replicas", "0", "--max-replicas", "2")
    assert knobs.exit_code == 0, knobs.output
    assert knobs.output.startswith("changed qwen: min_replicas (none) → 0; max_replicas (none) → 2\n"), knobs.output
    assert "its replicas keep running (nothing they run with changed)" in knobs.output
    assert "rolls" not in knobs.output
    assert "the plan's figures moved since (gib_per_gpu" in knobs.output and "kept as declared" in knobs.output
    last = (await control(bus))[-1]
    assert isinstance(last, m.ModelDeclared)
    assert (last.spec.min_replicas, last.spec.max_replicas) == (0, 2)
    assert (last.spec.gib_per_gpu, last.spec.kv_tokens) == (older.gib_per_gpu, older.kv_tokens)
    from llmgw.scheduler.placement import same_run

    assert same_run(older, last.spec)  # what the scheduler rolls by: nothing to roll

    # An input the engine runs with: it rolls, and the printout says which derived figures moved with it.
    longer = await invoke(nats_url, *deploy_args("--candidate", "1", "--context", "32768",
                                                 "--min-replicas", "0", "--max-replicas", "2"))
    assert longer.exit_code == 0, longer.output
    assert "changed qwen: context 16,384 → 32,768\n" in longer.output
    assert "the scheduler rolls it" in longer.output
    assert "  the plan's figures for it: gib_per_gpu" in longer.output and "kv_tokens" in longer.output


async def test_many_entries_are_planned_on_one_connection_and_declared_in_one_batch_in_file_order(
        bus: Bus, nats_url: str, tmp_path: Path) -> None:
    f = tmp_path / "many.toml"
    f.write_text("".join(f'[[model]]\nname = "m{i:03d}"\nmodel = "Qwen/Qwen2.5-14B-Instruct"\nprecision = "bf16"\n'
                         f'tp = 1\ngpu_class = "H100-80GB"\ncontext = {8192 + 1024 * (i % 3)}\n\n' for i in range(60)))
    first = await invoke(nats_url, *apply_args(f))
    assert first.exit_code == 0, first.output
    declared = [e for e in await control(bus) if isinstance(e, m.ModelDeclared)]
    assert [e.spec.name for e in declared] == [f"m{i:03d}" for i in range(60)]
    assert [e.spec.context for e in declared[:3]] == [8192, 9216, 10240]
    again = await invoke(nats_url, *apply_args(f))
    assert again.exit_code == 0 and "0 declared or changed, 60 unchanged" in again.output
    assert len(await control(bus)) == 60
