"""What ``ctl model plan`` and ``deploy`` decide: a plan here or from the planner, and the candidate chosen."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from llmgw import messages as m
from llmgw.config import Settings
from llmgw.ctl.ask import connect
from llmgw.errors import LlmgwError, PlanError

if TYPE_CHECKING:
    pass




def local_model(model: str, models_dir: str | None, params: int | None) -> m.ModelInfo | None:
    """The model read here when it is a directory or in the models directory; else the planner reads it."""
    from llmgw.planner import modelinfo

    md = modelinfo.models_dir(models_dir)
    if modelinfo.local_dir(model, md) is not None:  # a name too long for a path is no folder, not a crash
        return modelinfo.load(model, models_dir_=md, params=params)
    return None


def plan_locally(model: str, fleet_path: Path, request: m.PlanRequest, models_dir: str | None) -> m.PlanReply:
    """What-if: plan against a fleet file, without NATS."""
    return _local_planner(fleet_path)(model, request, models_dir)


def _local_planner(fleet_path: Path) -> Callable[[str, m.PlanRequest, str | None], m.PlanReply]:
    """A planner for the fleet file, read and folded once (``plan_many`` plans many models against it)."""
    from llmgw import fleetfile
    from llmgw.fleet.state import fold
    from llmgw.planner import candidates as planner
    from llmgw.planner import modelinfo

    fleet = fleetfile.load(fleet_path)
    reports = fleetfile.inventories(fleet, m.utcnow())
    state = fold(reports)
    versions = {r.node: r.vllm_version for r in reports}

    def local(model: str, request: m.PlanRequest, models_dir: str | None) -> m.PlanReply:
        info = modelinfo.load(model, models_dir_=models_dir, params=request.params)
        return planner.plan(info, state, request, engine_versions=versions)

    return local


async def plan_remotely(settings: Settings, request: m.PlanRequest) -> m.PlanReply:
    """Ask a running planner over NATS."""
    from llmgw.errors import ConnectError
    from llmgw.planner.service import ask

    try:
        bus = await connect(settings, "llmgw-ctl-plan")
    except ConnectError as e:
        raise ConnectError(f"{e}; or plan without NATS against a fleet file: --fleet FILE") from e
    try:
        return await ask(bus, request)
    finally:
        await bus.close()


async def plan(settings: Settings, model: str, request: m.PlanRequest, *, fleet: Path | None = None,
               models_dir: str | None = None) -> m.PlanReply:
    """A plan against ``fleet`` (a file, no NATS) or from the running planner; a model found here is read here."""
    if fleet is not None:
        return plan_locally(model, fleet, request, models_dir)
    info = local_model(model, models_dir, request.params)
    return await plan_remotely(settings, msgspec.structs.replace(request, info=info))


async def plan_many(settings: Settings, asks: Sequence[tuple[str, m.PlanRequest]], *, fleet: Path | None = None,
                    models_dir: str | None = None, in_flight: int = 16) -> list[m.PlanReply | LlmgwError]:
    """``plan`` for each (model, request), in order, on one connection with ``in_flight`` questions at once
    (``apply``'s 1,000 entries: one connection, not 1,000); a plan that failed is its error, in its place."""
    infos: dict[tuple[str, int | None], m.ModelInfo | None] = {}

    def info(model: str, params: int | None) -> m.ModelInfo | None:  # many entries share a model: read it once
        if (model, params) not in infos:
            infos[model, params] = local_model(model, models_dir, params)
        return infos[model, params]

    if fleet is not None:
        local = _local_planner(fleet)
        out: list[m.PlanReply | LlmgwError] = []
        for model, request in asks:
            try:
                out.append(local(model, request, models_dir))
            except LlmgwError as e:
                out.append(e)
        return out
    import asyncio  # not at the top: ``ctl status`` binds this module and runs no event loop

    from llmgw.errors import ConnectError
    from llmgw.planner.service import ask

    try:
        bus = await connect(settings, "llmgw-ctl-plan")
    except ConnectError as e:
        raise ConnectError(f"{e}; or plan without NATS against a fleet file: --fleet FILE") from e
    slots = asyncio.Semaphore(in_flight)

    async def one(model: str, request: m.PlanRequest) -> m.PlanReply | LlmgwError:
        async with slots:
            try:
                return await ask(bus, msgspec.structs.replace(request, info=info(model, request.params)))
            except LlmgwError as e:
                return e

    try:
        return list(await asyncio.gather(*(one(model, request) for model, request in asks)))
    finally:
        await bus.close()


def choose(reply: m.PlanReply, *, candidate: int | None, gpu_class: str | None, engine: str | None,
           pp: int | None = None) -> m.Candidate:
    """The candidate to deploy: the N-th the planner listed, or the best one matching the flags.

    Refuses (PlanError) with the planner's reason when what was asked for does not fit.
    """
    fitting = [c for c in reply.candidates if c.fits]
    if candidate is not None:
        if not 1 <= candidate <= len(fitting):
            listed = f"candidates 1 to {len(fitting)}" if fitting else "no candidate that fits"
            why = f" ({'; '.join(reply.notes)})" if reply.notes else ""
            raise PlanError(f"--candidate {candidate}: the planner lists {listed} for {reply.model}{why}; "
                            f"see `llmgw ctl model plan {reply.model}`")
        chosen = fitting[candidate - 1]
    else:
        pool = list(reply.candidates)
        if gpu_class is not None:
            classes = sorted({c.gpu_class for c in reply.candidates})
            pool = [c for c in pool if c.gpu_class == gpu_class]
            if not pool:
                have = ", ".join(classes) if classes else "none with a live healthy GPU"
                raise PlanError(f"no node has {gpu_class} GPUs (classes in the fleet: {have}); choose --gpu-class from those")
        if pp is not None:
            pool = [c for c in pool if c.pp == pp]
        if not pool:
            raise PlanError(f"the planner found no split of {reply.model}: {'; '.join(reply.notes) or 'nothing fits'}")
        fits = [c for c in pool if c.fits]
        if not fits:
            best = pool[0]
            raise PlanError(f"{reply.model} at {best.precision}, tp={best.tp}, pp={best.pp} on {best.gpu_class} does not fit: "
                            f"{best.reason}; see `llmgw ctl model plan {reply.model} --all` for what does")
        chosen = fits[0]
    if engine is not None and engine != chosen.engine:
        raise PlanError(f"precision {chosen.precision} is served by {chosen.engine}, not {engine}; "
                        f"{'GGUF precisions (q8_0, q6_K, q5_K_M, q4_K_M)' if engine == 'llama.cpp' else 'bf16, fp16, fp8, awq or gptq'} "
                        f"are served by {engine}: change --precision or drop --engine")
    return chosen


def gguf_file(chosen: m.Candidate, given: str) -> str:
    """``deploy --file``: a file here is recorded by its absolute path, a bare name as it is
    (looked up in the model's directory, or downloaded from its repository, by the agent)."""
    if chosen.engine != "llama.cpp":
        raise PlanError(f"--file names a GGUF for llama.cpp, but the chosen candidate runs {chosen.precision} on "
                        f"{chosen.engine}; add --precision q8_0 (or another GGUF precision), or drop --file")
    path = Path(given).expanduser()
    if path.is_file():
        return str(path.resolve())
    if path.name != given:
        raise PlanError(f"--file {given}: no such file here; give a path to the GGUF, or a bare file name that "
                        f"{chosen.source} holds")
    if not given.endswith(".gguf"):
        raise PlanError(f"--file {given}: llama.cpp serves a .gguf file; name one, e.g. {chosen.file}")
    return given


# --- the control stream ------------------------------------------------------------------------------
