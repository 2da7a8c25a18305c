"""The router's pool: which replicas may take traffic, folded from the control stream.

A pure fold (``Pool.apply``) kept here with the other folds of the fleet core, so
that every reader (the projector, a replay) folds it too and a fold snapshot
carries it: a router restarts from the newest snapshot (``EndpointSink``) rather
than from the control stream's first sequence. Only a placed replica whose latest
state, reported by a node it was placed on, is ``healthy`` with an endpoint is in
the pool; unhealthy, failed, stopping or stopped leaves it at once. The pool also
carries the outstanding-request counts that the router's acquire uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw import messages as m
from llmgw.fleet.state import model_state, part_state


@dataclass(eq=False)
class Replica:
    """One replica as the router sees it: where it is, how it is, how busy it is."""

    replica_id: str
    model: str
    state: str = "placed"
    endpoint: str = ""
    outstanding: int = 0
    in_pool: bool = False
    # Wall clock when this router put the replica in its pool (for serving_since).
    pooled_at: float = 0.0
    # Over several nodes: each node's part; routable only when every part is healthy.
    nodes: tuple[str, ...] = ()
    parts: dict[str, str] = field(default_factory=dict)
    # Control-stream sequences of its placement and of the report that set its endpoint (snapshot checks).
    placed_seq: int = 0
    endpoint_seq: int = 0
    # The LoRA adapters its engine attached at start, in order (llama.cpp: their ids); vLLM's are loaded
    # at runtime and known to the router that loaded them (``llmgw.router.adapters``).
    adapters: tuple[str, ...] = ()


@dataclass
class Adapter:
    """A declared LoRA adapter as the router needs it: its base, where an engine reads it, its scale."""

    base: str
    path: str
    scale: float = 1.0


@dataclass
class Declared:
    """A declared model as the router needs it: can a request wake it, or why not."""

    replicas_wanted: int
    replicas_by: str = "declared"  # declared | operator | autoscaler
    unplaceable: str | None = None
    routing: str = "prefix"  # ModelSpec.routing: how the router picks among its replicas
    declared_at: float = 0.0  # when (Unix seconds): /v1/models' ``created``
    # Requests one replica serves at once (llama.cpp's slots, vLLM's --max-num-seqs); 0: not said.
    capacity: int = 0
    engine: str = ""
    max_adapters: int = 0  # vLLM's --max-loras: adapters one replica holds at once


@dataclass
class Pool:
    """Replicas by id and the healthy ones by model; mutated only by the sink."""

    replicas: dict[str, Replica] = field(default_factory=dict)
    healthy: dict[str, list[Replica]] = field(default_factory=dict)
    # Models anyone declared or placed: "no such model" (404) differs from
    # "no healthy replica right now" (503).
    # (A dict for its order: a set of strings encodes in an order each process's hash seed picks,
    # and a checkpoint's bytes must not depend on which process folded it.)
    known_models: dict[str, None] = field(default_factory=dict)
    declared: dict[str, Declared] = field(default_factory=dict)
    adapters: dict[str, Adapter] = field(default_factory=dict)

    def models(self) -> list[str]:
        """Models with at least one healthy replica."""
        return sorted(name for name, reps in self.healthy.items() if reps)

    def model_state(self, name: str) -> str:
        """serving, starting, parked, unplaceable, stopped, or unknown (placed by no declaration we saw).

        The same states as ``FleetState.model_states``, from this router's view.
        """
        healthy = bool(self.healthy.get(name))
        placed = healthy or any(r.model == name for r in self.replicas.values())
        d = self.declared.get(name)
        if d is None:
            return "serving" if healthy else "starting" if placed else "unknown"
        return model_state(healthy=healthy, placed=placed, replicas_wanted=d.replicas_wanted,
                           replicas_by=d.replicas_by, unplaceable=d.unplaceable)

    def listed(self) -> dict[str, str]:
        """Every model a request can reach or wake, with its state (stopped ones are not listed)."""
        names = set(self.declared) | {n for n, reps in self.healthy.items() if reps}
        states = {n: self.model_state(n) for n in sorted(names)}
        return {n: st for n, st in states.items() if st != "stopped"}

    def created(self, name: str) -> int:
        """When a model came to be, as OpenAI's ``created`` (Unix seconds): declared, else first pooled; 0: unknown."""
        d = self.declared.get(name)
        if d is not None and d.declared_at:
            return int(d.declared_at)
        pooled = [r.pooled_at for r in self.healthy.get(name, ()) if r.pooled_at]
        return int(min(pooled)) if pooled else 0

    def states(self) -> dict[str, int]:
        """How many replicas are in each state."""
        out: dict[str, int] = {}
        for r in self.replicas.values():
            out[r.state] = out.get(r.state, 0) + 1
        return out

    def _enter(self, rep: Replica, now: float) -> None:
        if not rep.in_pool:
            rep.in_pool, rep.pooled_at = True, now
            self.healthy.setdefault(rep.model, []).append(rep)

    def _leave(self, rep: Replica) -> None:
        if rep.in_pool:
            rep.in_pool = False
            reps = self.healthy.get(rep.model, [])
            if rep in reps:
                reps.remove(rep)
            if not reps:
                self.healthy.pop(rep.model, None)

    def apply(self, event: m.ControlEvent, now: float, seq: int = 0) -> bool:
        """Fold one control event stored at ``seq``; True when the pool changed. ``now`` is the router's wall clock."""
        match event:
            case m.ModelDeclared(spec=spec):
                self.known_models[spec.name] = None
                self.declared[spec.name] = Declared(
                    spec.replicas, routing=spec.routing, declared_at=event.at.timestamp(),
                    capacity=spec.slots if spec.engine == "llama.cpp" else spec.parallel, engine=spec.engine,
                    max_adapters=spec.max_adapters)
                return True
            case m.AdapterDeclared(spec=a):
                self.adapters[a.name] = Adapter(a.base, a.path, a.scale)
                return True
            case m.AdapterRemoved(name=name):
                return self.adapters.pop(name, None) is not None
            case m.ModelScaled(name=name, replicas=n) | m.ModelAutoscaled(name=name, replicas=n):
                d = self.declared.get(name)
                if d is not None:
                    d.replicas_wanted, d.replicas_by = n, "operator" if type(event) is m.ModelScaled else "autoscaler"
                    return True
            case m.ModelUnplaceable(name=name, reason=reason):
                d = self.declared.get(name)
                if d is not None:
                    d.unplaceable = reason
                    return True
            case m.ModelRemoved(name=name):
                self.declared.pop(name, None)
                if not any(r.model == name for r in self.replicas.values()):
                    self.known_models.pop(name, None)
                return True
            case m.ReplicaPlaced(replica_id=rid, model=model):
                self.known_models[model] = None
                if (d := self.declared.get(model)) is not None:
                    d.unplaceable = None
                rep = self.replicas.get(rid)
                if rep is not None and rep.model != model:  # the id reused for another model: a new replica
                    self._leave(rep)
                    rep = None
                attached = tuple(a.name for a in event.spec.adapters)
                if rep is None:
                    self.replicas[rid] = Replica(replica_id=rid, model=model, nodes=event.nodes, placed_seq=seq,
                                                 adapters=attached)
                else:
                    # Placed again (as the fold takes it): its nodes now are the ones that speak for it, and
                    # this placement is the one a snapshot of the pool names (snapshots.unfounded checks it).
                    rep.nodes, rep.placed_seq, rep.adapters = event.nodes, seq, attached
                return True
            case m.ReplicaStateChanged(replica_id=rid, state=state, endpoint=endpoint):
                rep = self.replicas.get(rid)
                if rep is None:
                    return False  # never placed, or stopped already: no agent's word makes it routable
                # A report from a node it is not on never gets here: the one fold refused it (fold_batch).
                if state == "stopped":
                    self._leave(rep)
                    del self.replicas[rid]
                    return True
                was = (rep.in_pool, rep.endpoint)
                whole: str = state
                if len(rep.nodes) > 1:
                    rep.parts[event.node] = state
                    whole = part_state(rep.nodes, rep.parts)
                    if event.node != rep.nodes[0]:
                        endpoint = ""  # only the head serves; a worker's report never moves the endpoint
                rep.state = whole
                if endpoint:
                    rep.endpoint, rep.endpoint_seq = endpoint.rstrip("/"), seq
                if whole == "healthy" and rep.endpoint:
                    if rep.in_pool and was[1] != rep.endpoint:
                        self._leave(rep)  # moved: count it as new from now
                    self._enter(rep, now)
                else:
                    self._leave(rep)
                return was != (rep.in_pool, rep.endpoint)
            case m.ReplicaStopped(replica_id=rid):
                gone = self.replicas.pop(rid, None)
                if gone is not None:
                    self._leave(gone)
                    return True
        return False

    def __eq__(self, other: object) -> bool:
        # By value (a Replica compares by identity, for the router's acquire): two folds agree.
        if not isinstance(other, Pool):
            return NotImplemented
        return self._view() == other._view()

    def _view(self) -> tuple[object, ...]:
        reps = {rid: (r.model, r.state, r.endpoint, r.in_pool, r.nodes, r.parts, r.outstanding, r.pooled_at,
                      r.adapters) for rid, r in self.replicas.items()}
        healthy = {model: sorted(r.replica_id for r in reps_) for model, reps_ in self.healthy.items()}
        return reps, healthy, self.known_models, self.declared, self.adapters

    def __post_init__(self) -> None:
        # Decoded from a snapshot: ``healthy`` is rebuilt from ``replicas``, whatever it said (the very
        # Replica objects, and nothing a snapshot could slip in beside them unchecked).
        self.healthy = {}
        for rep in self.replicas.values():
            if rep.in_pool:
                self.healthy.setdefault(rep.model, []).append(rep)
