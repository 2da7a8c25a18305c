"""``ctl adapter add/remove/list`` against a real bus: read from the adapter's files, refused with the reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_cli_sharing import control, ctl, publish
from test_e2e import LLMGW

from llmgw import messages as m
from llmgw.config import Settings


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model as a GGUF (llama.cpp) with two adapters, as safetensors (vLLM) with one, and a wider model."""
    root = tmp_path_factory.mktemp("demo")
    for args in ((str(root / "tiny"), "--lora", "sql", "--lora", "law"),
                 (str(root / "tinyhf"), "--format", "hf", "--lora", "sql"),
                 (str(root / "wide"), "--embd", "128", "--lora", "big")):
        made = subprocess.run([LLMGW, "demo-model", *args], capture_output=True, text=True, timeout=120, check=False)
        assert made.returncode == 0, made.stdout + made.stderr
    return {"tiny": root / "tiny", "tinyhf": root / "tinyhf", "wide": root / "wide"}


def base(name: str, source: Path, engine: str, **kw: object) -> m.ModelDeclared:
    return m.ModelDeclared(at=m.utcnow(), spec=m.ModelSpec(
        name=name, source=str(source), precision="q8_0" if engine == "llama.cpp" else "bf16", engine=engine,
        gpu_class="CPU-16GB", context=1024, gib_per_gpu=0.6, **kw))  # type: ignore[arg-type]


def test_adding_an_adapter_to_a_llama_cpp_base_attaches_it_by_a_new_declaration(settings: Settings,
                                                                                 demo: dict[str, Path]) -> None:
    publish(settings, [base("tiny", demo["tiny"], "llama.cpp")], fresh=True)
    out = ctl(settings, "ctl", "adapter", "add", "sql", str(demo["tiny"] / "loras" / "sql.gguf"), "--base", "tiny")
    assert out.exit_code == 0, out.output
    assert "declared adapter sql on tiny: gguf, rank 8" in out.output and "rolls its replicas" in out.output
    specs = [e.spec for e in control(settings) if isinstance(e, m.ModelDeclared)]
    assert [a.name for a in specs[-1].adapters] == ["sql"]
    assert specs[-1].gib_per_gpu > specs[0].gib_per_gpu  # its tensors are in the booking
    again = ctl(settings, "ctl", "adapter", "add", "sql", str(demo["tiny"] / "loras" / "sql.gguf"), "--base", "tiny")
    assert "unchanged sql" in again.output  # the same add twice publishes nothing
    listed = json.loads(ctl(settings, "ctl", "adapter", "list", "--json").output)
    assert [(a["name"], a["base"], a["rank"], a["format"]) for a in listed] == [("sql", "tiny", 8, "gguf")]
    gone = ctl(settings, "ctl", "adapter", "remove", "sql")
    assert gone.exit_code == 0 and "re-declared without it" in gone.output
    last = [e.spec for e in control(settings) if isinstance(e, m.ModelDeclared)][-1]
    assert last.adapters == () and last.gib_per_gpu == pytest.approx(specs[0].gib_per_gpu, abs=1e-6)


@pytest.mark.parametrize(("case", "words"), [
    ("another model's", "cannot run on tiny"),
    ("the other engine's form", "is a peft adapter; tiny runs llama.cpp"),
    ("a model's name", "is a declared model's name"),
    ("no base", "no model named 'nothere' is declared"),
    ("no such file", "does not exist"),
    ("vLLM without slots", "was declared without LoRA; redeploy it with --max-adapters"),
])
def test_an_adapter_that_cannot_run_there_is_refused_with_the_reason(settings: Settings, demo: dict[str, Path],
                                                                     case: str, words: str) -> None:
    publish(settings, [base("tiny", demo["tiny"], "llama.cpp"), base("hf", demo["tinyhf"], "vllm")], fresh=True)
    source, name, on = {
        "another model's": (demo["wide"] / "loras" / "big.gguf", "big", "tiny"),
        "the other engine's form": (demo["tinyhf"] / "loras" / "sql", "sql", "tiny"),
        "a model's name": (demo["tiny"] / "loras" / "sql.gguf", "hf", "tiny"),
        "no base": (demo["tiny"] / "loras" / "sql.gguf", "sql", "nothere"),
        "no such file": (demo["tiny"] / "loras" / "nothere.gguf", "sql", "tiny"),
        "vLLM without slots": (demo["tinyhf"] / "loras" / "sql", "sql", "hf"),
    }[case]
    out = ctl(settings, "ctl", "adapter", "add", name, str(source), "--base", on)
    assert out.exit_code == 1 and out.output.startswith("Error: ") and words in out.output, out.output
    assert "Traceback" not in out.output
    assert not [e for e in control(settings) if isinstance(e, m.AdapterDeclared)]  # nothing published


def test_a_vllm_base_takes_an_adapter_within_its_declared_rank(settings: Settings, demo: dict[str, Path]) -> None:
    publish(settings, [base("hf", demo["tinyhf"], "vllm", max_adapters=2, max_lora_rank=8)], fresh=True)
    out = ctl(settings, "ctl", "adapter", "add", "sql", str(demo["tinyhf"] / "loras" / "sql"), "--base", "hf")
    assert out.exit_code == 0, out.output
    assert "a router loads it where none does" in out.output
    assert len([e for e in control(settings) if isinstance(e, m.ModelDeclared)]) == 1  # vLLM: no re-declaration


def test_ctl_idle_names_the_adapters_nobody_asked_for(settings: Settings, demo: dict[str, Path]) -> None:
    now = m.utcnow()
    spec = base("hf", demo["tinyhf"], "vllm", max_adapters=2, max_lora_rank=8)
    adapters = [m.AdapterDeclared(at=now, spec=m.AdapterSpec(name=n, base="hf", source=n, path=f"/a/{n}",
                                                             format="peft", rank=8, alpha=16)) for n in ("a", "b")]
    used = m.IdleMapPublished(at=now, router="gw", boot_id="x", tick=1,
                              callers={"-": {"a": m.KeyUse(requests=2, prompt_tokens=4, completion_tokens=2)}})
    publish(settings, [spec, *adapters, used], fresh=True)
    out = ctl(settings, "ctl", "idle", "--older-than", "1h", "--replay", "--json")
    assert out.exit_code == 0, out.output
    assert [a["name"] for a in json.loads(out.output)["adapters_idle"]] == ["b"]  # a was asked for (anonymously)
    text = ctl(settings, "ctl", "idle", "--older-than", "1h", "--replay")
    assert "LoRA adapters nobody asked for in 1h: b (hf)" in text.output


def test_apply_takes_adapter_entries_once(settings: Settings, demo: dict[str, Path], tmp_path: Path) -> None:
    publish(settings, [base("tiny", demo["tiny"], "llama.cpp")], fresh=True)
    file = tmp_path / "lora.toml"
    file.write_text("".join(f'[[adapter]]\nname = "{n}"\nsource = "{demo["tiny"] / "loras" / f"{n}.gguf"}"\n'
                            'base = "tiny"\n\n' for n in ("sql", "law")))
    first = ctl(settings, "apply", str(file))
    assert first.exit_code == 0, first.output
    assert "declared adapter sql on tiny (gguf, rank 8); tiny re-declared with it attached" in first.output
    last = [e.spec for e in control(settings) if isinstance(e, m.ModelDeclared)][-1]
    assert [a.name for a in last.adapters] == ["sql", "law"]
    again = ctl(settings, "apply", str(file))
    assert again.exit_code == 0 and again.output.count("unchanged adapter") == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[[adapter]]\nname = "x"\nsource = "y"\nbase = "tiny"\nrank = 8\n')
    refused = ctl(settings, "apply", str(bad))
    assert refused.exit_code == 1 and "adapter[0]" in refused.output and "rank" in refused.output
