"""LoRA adapters as their files state them, checked against their base, and what they cost on a GPU."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from llmgw import messages as m
from llmgw.errors import ModelError
from llmgw.fleet.state import FleetState, apply
from llmgw.planner import adapters, modelinfo
from llmgw.planner.candidates import Split, evaluate
from llmgw.planner.memory import MIB, precision

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = ROOT / "examples" / "models" / "meta-llama__Llama-3.1-8B-Instruct"


def peft(d: Path, rank: int = 8, alpha: float = 16, hidden: int = 4096, q: int = 4096, kv: int = 1024,
         layers: int = 32, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A PEFT adapter's config and safetensors header (its tensors left zero: only the header is read)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
        "base_model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}))
    out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    header: dict[str, object] = {}
    offset = 0
    for i in range(layers):
        for mod in modules:
            for part, shape in (("A", [rank, hidden]), ("B", [out[mod], rank])):
                size = 2 * shape[0] * shape[1]
                header[f"base_model.model.model.layers.{i}.self_attn.{mod}.lora_{part}.weight"] = {
                    "dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
    raw = json.dumps(header).encode()
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return d


def test_a_peft_adapter_is_read_from_its_own_files(tmp_path: Path) -> None:
    facts = adapters.read(peft(tmp_path / "a"))
    assert (facts.format, facts.rank, facts.alpha, facts.target_modules, facts.layers) == (
        "peft", 8, 16.0, ("q_proj", "v_proj"), 32)
    # Per layer: q (8x4096 + 4096x8) and v (8x4096 + 1024x8), bf16.
    assert facts.size_bytes == 32 * 2 * (8 * 4096 + 4096 * 8 + 8 * 4096 + 1024 * 8)
    info = modelinfo.load_dir(LLAMA_8B)
    assert adapters.check_base(facts, info) is None


def test_an_adapter_of_another_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    info = modelinfo.load_dir(LLAMA_8B)
    wide = adapters.read(peft(tmp_path / "wide", hidden=5120, q=5120))
    assert adapters.check_base(wide, info) == (
        "its q_proj is 5120 → 5120 wide; meta-llama/Llama-3.1-8B-Instruct's is 4096 → 4096 (hidden size 4096): "
        "an adapter of another model")
    deep = adapters.read(peft(tmp_path / "deep", layers=40))
    assert adapters.check_base(deep, info) == "it adapts 40 layers; meta-llama/Llama-3.1-8B-Instruct has 32"


def test_bad_adapter_files_get_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        adapters.read(tmp_path / "nothere")
    bad = peft(tmp_path / "bad")
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ModelError, match=r"r = 4, its tensors have rank \[8\]"):
        adapters.read(bad)
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ModelError, match="not a LoRA adapter"):
        adapters.read(tmp_path / "x.gguf")
    (tmp_path / "huge.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0))
    with pytest.raises(ModelError, match="more than an adapter has"):
        adapters.read(tmp_path / "huge.gguf")
    (tmp_path / "cut.safetensors").write_bytes(b"\x01")
    with pytest.raises(ModelError, match="not a GGUF file"):
        adapters.read(tmp_path / "cut.safetensors")


def test_vllm_lora_buffers_are_charged_as_its_version_sizes_them() -> None:
    info = modelinfo.load_dir(LLAMA_8B)
    # max_loras x rank x 2 bytes x (layers x (7H + 2q + 2kv + 3I) + 2V + 2H), at tp 1.
    want = 4 * 16 * 2 * (32 * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) + 2 * 128256 + 2 * 4096)
    assert adapters.lora_bytes_per_gpu(info, "vllm", 1, max_loras=4, max_rank=16) == want
    assert adapters.lora_bytes_per_gpu(info, "vllm", 1, max_loras=4, max_rank=10) == want  # vLLM rounds to 16
    assert adapters.vllm_rank(300) == 320 and adapters.vllm_rank(0) == 0
    # The plan takes it out of the KV cache, and the declaration carries what the engine is started with.
    split = Split("H100-80GB", None, 81559, 1)
    plain = evaluate(info, precision("bf16"), split, context=8192, util=None, replicas_now=1)
    lora = evaluate(info, precision("bf16"), split, context=8192, util=None, replicas_now=1, lora=(4, 16, 0))
    assert lora.lora_gib_per_gpu == pytest.approx(want / 1024 / MIB, abs=0.01)
    assert plain.kv_gib_per_gpu - lora.kv_gib_per_gpu == pytest.approx(want / 1024 / MIB, abs=0.02)
    spec = lora.spec("llama8")
    assert (spec.max_adapters, spec.max_lora_rank) == (4, 16)


def test_llama_cpp_books_its_attached_adapters_bytes() -> None:
    info = modelinfo.load_dir(LLAMA_8B)
    split = Split("L4-24GB", None, 23034, 1)
    plain = evaluate(info, precision("q4_K_M"), split, context=4096, util=None, replicas_now=1)
    with_two = evaluate(info, precision("q4_K_M"), split, context=4096, util=None, replicas_now=1,
                        lora=(0, 0, 2 * 160 * MIB))
    assert with_two.spec("x").gib_per_gpu - plain.spec("x").gib_per_gpu == pytest.approx(320 / 1024, abs=0.01)


def test_the_fold_keeps_adapters_and_who_holds_them() -> None:
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    spec = m.AdapterSpec(name="sql", base="llama8", source="./sql", path="/a/sql", format="peft", rank=8, alpha=16)
    base = m.ModelSpec(name="llama8", source="x", precision="bf16", engine="vllm", gpu_class="H100-80GB",
                       context=8192, max_adapters=2, max_lora_rank=16)
    s = FleetState()
    for e in (m.ModelDeclared(at=t0, spec=base), m.AdapterDeclared(at=t0, spec=spec),
              m.ReplicaPlaced(at=t0, replica_id="llama8-r1", model="llama8", nodes=("n",), gpus=(), spec=base,
                              fabric="f"),
              m.AdapterLoaded(at=t0 + timedelta(seconds=1), router="gw", replica_id="llama8-r1", adapter="sql")):
        apply(s, e)
    assert s.adapters_held(s.replicas["llama8-r1"]) == ("sql",)
    apply(s, m.AdapterUnloaded(at=t0 + timedelta(seconds=2), router="gw", replica_id="llama8-r1", adapter="sql"))
    assert s.adapters_held(s.replicas["llama8-r1"]) == ()
    apply(s, m.AdapterRemoved(at=t0, name="sql"))
    assert s.adapters == {}


def test_duckdb_counts_what_keys_asked_of_each_adapter(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    import duckdb
    from analyst_history import project

    t0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
    spec = m.AdapterSpec(name="sql", base="llama8", source="./sql", path="/a/sql", format="peft", rank=8, alpha=16)
    use = {"sql": m.KeyUse(requests=3, prompt_tokens=30, completion_tokens=9),
           "llama8": m.KeyUse(requests=5, prompt_tokens=50, completion_tokens=10)}
    project(tmp_path / "a.duckdb", [
        m.AdapterDeclared(at=t0, spec=spec),
        m.IdleMapPublished(at=t0, router="gw", boot_id="b", tick=1, callers={"team-a": use}),
    ]).close()
    con = duckdb.connect(str(tmp_path / "a.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT adapter, base, key_name, requests, prompt_tokens, completion_tokens "
                           "FROM usage_by_adapter_daily").fetchall()
    finally:
        con.close()
    assert rows == [("sql", "llama8", "team-a", 3, 30, 9)]  # the base's own requests are not an adapter's
    from llmgw.projections.store import usage_rows

    # ctl usage --by adapter reads the same view.
    assert usage_rows(tmp_path / "a.duckdb", "adapter", 3650) == [("sql", 3, 0, 0, 0, 30, 9, 0)]


def test_duckdb_says_how_long_nobody_asked_for_each_adapter(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    import duckdb
    from analyst_history import project

    t0 = datetime(2026, 3, 1, 12, tzinfo=UTC)

    def declared(name: str) -> m.AdapterDeclared:
        return m.AdapterDeclared(at=t0, spec=m.AdapterSpec(name=name, base="llama8", source=name, path=f"/a/{name}",
                                                           format="peft", rank=8, alpha=16))

    project(tmp_path / "i.duckdb", [
        declared("sql"), declared("law"), declared("old"),
        m.IdleMapPublished(at=t0 + timedelta(minutes=10), router="gw", boot_id="b", tick=1,
                           callers={"-": {"sql": m.KeyUse(requests=1)}}),
        m.AdapterRemoved(at=t0 + timedelta(minutes=20), name="old"),
        m.IdleMapPublished(at=t0 + timedelta(hours=1), router="gw", boot_id="b", tick=2),
    ]).close()
    con = duckdb.connect(str(tmp_path / "i.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT adapter, idle_s FROM adapter_idle ORDER BY adapter").fetchall()
    finally:
        con.close()
    assert rows == [("law", 3600.0), ("sql", 3000.0)]  # old was removed; law never asked: since declared
