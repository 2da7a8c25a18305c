"""What ``ctl adapter`` decides and publishes: LoRA adapters declared on a base model, and removed.

An adapter is read from its own files (``llmgw.planner.adapters``), checked against its
base's config.json, and refused with the reason when it cannot run there: another
model's adapter, a rank above what the base's vLLM was declared for, the wrong form for
the base's engine. A llama.cpp base attaches every adapter at start, so adding or removing
one re-declares the base with its adapters (and the memory they take): the scheduler rolls
it, each new replica healthy before an old one stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.config import Settings
from llmgw.ctl.ask import connect, replay_state
from llmgw.errors import LlmgwError, ModelError

GIB = 1 << 30


@dataclass(frozen=True)
class AdapterChange:
    adapter: m.AdapterSpec
    seq: int  # the AdapterDeclared / AdapterRemoved
    base_seq: int | None = None  # the base re-declared with it (llama.cpp), or None
    unchanged: bool = False


def resolve_source(source: str) -> Path:
    """A local directory or file, or a Hugging Face repo id found in the local cache (never the network)."""
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if "/" in source and not source.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(source, local_files_only=True))
        except Exception as e:  # huggingface_hub raises several kinds for "not cached"
            raise LlmgwError(f"{source} is neither a path here nor a repository in the local Hugging Face cache "
                             f"({type(e).__name__}); download it first (`huggingface-cli download {source}`) "
                             "or give its directory") from None
    raise LlmgwError(f"{source} does not exist; give the adapter's directory (PEFT) or file (GGUF)")


def adapter_spec(name: str, base: m.ModelSpec, source: str, models_dir: str | None) -> m.AdapterSpec:
    """The declaration of an adapter on ``base``, read from its files; LlmgwError saying why it cannot run there."""
    from llmgw.planner import adapters, modelinfo

    path = resolve_source(source)
    try:
        facts = adapters.read(path)
        info = modelinfo.load(base.source, models_dir_=models_dir)
    except ModelError as e:
        raise LlmgwError(str(e)) from None
    want = "peft" if base.engine == "vllm" else "gguf"
    if facts.format != want:
        form = "a PEFT directory (adapter_config.json + adapter_model.safetensors)" if want == "peft" else (
            "a GGUF adapter (llama.cpp's convert_lora_to_gguf.py writes one from a PEFT directory)")
        raise LlmgwError(f"adapter {name} is a {facts.format} adapter; {base.name} runs {base.engine}, which loads "
                         f"{form}")
    if (why := adapters.check_base(facts, info)) is not None:
        raise LlmgwError(f"adapter {name} cannot run on {base.name} ({base.source}): {why}")
    if base.engine == "vllm":
        if base.max_adapters <= 0:
            raise LlmgwError(f"{base.name} was declared without LoRA; redeploy it with --max-adapters N "
                             f"(and --max-lora-rank {adapters.vllm_rank(facts.rank)} or more), which rolls it")
        if facts.rank > base.max_lora_rank:
            raise LlmgwError(f"adapter {name} has rank {facts.rank}; {base.name} was declared for rank "
                             f"{base.max_lora_rank} at most; redeploy it with --max-lora-rank "
                             f"{adapters.vllm_rank(facts.rank)}, which rolls it")
    return facts.spec(name, base.name, source)


def _with_adapters(base: m.ModelSpec, attached: tuple[m.AdapterRef, ...], gib_delta: float) -> m.ModelSpec:
    return msgspec.structs.replace(base, adapters=attached,
                                   gib_per_gpu=round(max(0.0, base.gib_per_gpu + gib_delta), 6))


async def add(settings: Settings, name: str, base_name: str, source: str, models_dir: str | None) -> AdapterChange:
    """Declare adapter ``name`` on ``base_name`` (re-declaring a llama.cpp base with it attached)."""
    bus = await connect(settings, "llmgw-ctl-adapter")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL,))
        view = state.models.get(base_name)
        if view is None:
            names = ", ".join(sorted(state.models)) or "none"
            raise LlmgwError(f"no model named {base_name!r} is declared (declared: {names}); deploy the base first "
                             f"with `llmgw ctl model deploy {base_name} MODEL --from-plan`")
        if name in state.models:
            raise LlmgwError(f"{name!r} is a declared model's name; a request's model names one or the other, so "
                             "give the adapter another name")
        base = view.spec
        spec = adapter_spec(name, base, source, models_dir)
        old = state.adapters.get(name)
        if old is not None and old.base != base_name:
            raise LlmgwError(f"adapter {name} is declared on {old.base}; remove it first "
                             f"(`llmgw ctl adapter remove {name}`)")
        if old == spec:
            return AdapterChange(spec, 0, unchanged=True)
        seq = (await bus.publish(m.AdapterDeclared(at=m.utcnow(), spec=spec))).seq
        base_seq = None
        if base.engine == "llama.cpp":
            kept = tuple(a for a in base.adapters if a.name != name)
            delta = spec.size_bytes / GIB / base.tp - (old.size_bytes / GIB / base.tp if old is not None else 0)
            new = _with_adapters(base, (*kept, m.AdapterRef(name=name, path=spec.path)), delta)
            base_seq = (await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=new))).seq
        return AdapterChange(spec, seq, base_seq)
    finally:
        await bus.close()


async def remove(settings: Settings, name: str) -> AdapterChange:
    """Remove adapter ``name`` (re-declaring a llama.cpp base without it)."""
    bus = await connect(settings, "llmgw-ctl-adapter")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL,))
        spec = state.adapters.get(name)
        if spec is None:
            names = ", ".join(sorted(state.adapters)) or "none"
            raise LlmgwError(f"no adapter named {name!r} is declared (declared: {names}); "
                             "`llmgw ctl adapter list` shows them")
        seq = (await bus.publish(m.AdapterRemoved(at=m.utcnow(), name=name))).seq
        base_seq = None
        view = state.models.get(spec.base)
        if view is not None and any(a.name == name for a in view.spec.adapters):
            base = view.spec
            new = _with_adapters(base, tuple(a for a in base.adapters if a.name != name),
                                 -spec.size_bytes / GIB / base.tp)
            base_seq = (await bus.publish(m.ModelDeclared(at=m.utcnow(), spec=new))).seq
        return AdapterChange(spec, seq, base_seq)
    finally:
        await bus.close()


@dataclass(frozen=True)
class AdapterRow:
    spec: m.AdapterSpec
    held_by: tuple[str, ...]  # replicas whose engine holds it now
    base_engine: str


async def listed(settings: Settings) -> list[AdapterRow]:
    """Every declared adapter and the replicas holding it, folded from the control and usage streams."""
    from llmgw.fleet.status import adapter_status

    bus = await connect(settings, "llmgw-ctl-adapter")
    try:
        state = await replay_state(bus, (subjects.STREAM_CONTROL, subjects.STREAM_USAGE))
    finally:
        await bus.close()
    return [AdapterRow(state.adapters[a.name], a.held_by,
                       state.models[a.base].spec.engine if a.base in state.models else "")
            for a in adapter_status(state)]
