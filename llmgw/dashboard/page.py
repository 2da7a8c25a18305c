"""The dashboard's page: every section rendered here, from a status report, with every value escaped.

The page's script only swaps in the sections that changed (``SECTIONS``); nothing here
reads the bus or a clock, so each section is a pure function of what it is given.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime

from llmgw import messages as m


class Safe(str):
    """HTML that is already escaped (made here by ``el``); any other str is escaped where it is used."""


def esc(value: object) -> Safe:
    return value if isinstance(value, Safe) else Safe(html.escape(str(value), quote=True))


def el(tag: str, *children: object, **attrs: object) -> Safe:
    """``<tag attrs>children</tag>``; text children and every attribute value escaped (``cls`` is ``class``)."""
    attr = "".join(f' {"class" if k == "cls" else k.replace("_", "-")}="{esc(v)}"'
                   for k, v in attrs.items() if v is not None and v is not False)
    return Safe(f"<{tag}{attr}>{''.join(esc(c) for c in children)}</{tag}>")


def join(parts: Iterable[object]) -> Safe:
    return Safe("".join(esc(p) for p in parts))


def duration(seconds: float | None) -> str:
    """``3m 12s``, ``2h 05m``, ``4d 03h``; ``-`` for unknown (never a duration anyone could act on)."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def clock(t: datetime | None) -> str:
    return t.astimezone(UTC).strftime("%H:%M:%S") if t is not None else "-"


def gib(mib: float) -> str:
    return f"{mib / 1024:,.0f} GiB" if mib >= 10 * 1024 else f"{mib / 1024:,.1f} GiB"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


# --- the sections -------------------------------------------------------------------------------


def bar(parts: Iterable[tuple[str, int]], total: int) -> Safe:
    """A stacked bar as SVG (attributes, not inline styles, so the CSP needs no exception).

    A used or unhealthy GPU always shows: each non-empty part is at least 1% wide.
    """
    x = 0.0
    rects = []
    for cls, n in parts:
        if n <= 0 or total <= 0:
            continue
        w = max(100 * n / total, 1.0)
        w = min(w, 100 - x)
        rects.append(el("rect", cls=cls, x=f"{x:.2f}", y="0", width=f"{w:.2f}", height="10"))
        x += w
    return el("svg", *rects, cls="bar", viewBox="0 0 100 10", preserveAspectRatio="none", role="img")


def capacity_section(r: m.StatusReport) -> Safe:
    use = {u.gpu_class: u for u in r.gpu_use}
    rows = []
    for c in r.capacity:
        u = use.get(c.gpu_class)
        util = "-" if u is None or u.utilization_pct is None else f"{u.utilization_pct:.0f}%"
        mem = "-" if u is None or not u.memory_total_mib else f"{gib(u.memory_used_mib)} of {gib(u.memory_total_mib)}"
        rows.append(el(
            "div",
            el("div", el("span", c.gpu_class, cls="name"),
               el("span", f"{c.used} used · {c.free} free · {c.unhealthy} unhealthy · {c.lost} lost · {c.total} total",
                  cls="counts"), cls="row-head"),
            bar((("used", c.used), ("free", c.free), ("unhealthy", c.unhealthy), ("lost", c.lost)), c.total),
            el("div", f"utilization {util} · memory in use {mem}", cls="use"),
            cls="capacity", data_class=c.gpu_class,
        ))
    return join(rows) if rows else el("p", "no GPUs reported yet: start an agent", cls="empty")


def tenants_section(r: m.StatusReport) -> Safe:
    """Requests and tokens per tenant, today and over seven days; keys at 80 % of their daily tokens."""
    if not r.tenants:
        return el("p", "no API key used yet (", el("code", "llmgw ctl key create"), ")", cls="empty")
    head = el("tr", *(el("th", h) for h in ("tenant", "today", "7 days")))
    body = [el("tr", el("td", t.tenant or "-"),
               el("td", f"{t.requests_today:,} req · {t.tokens_today:,} tok", cls="num"),
               el("td", f"{t.requests_7d:,} req · {t.tokens_7d:,} tok", cls="num")) for t in r.tenants]
    near = [el("li", f"{k.name} ({k.tenant or '-'}): {k.tokens_today:,} of {k.tokens_per_day:,} tokens today",
               cls="near") for k in r.near_limits]
    return join([el("table", el("thead", head), el("tbody", *body)),
                 *([el("ul", *near, cls="near-limits")] if near else [])])


def fabrics_section(r: m.StatusReport) -> Safe:
    if not r.free_nodes:
        return el("p", "no nodes", cls="empty")
    head = el("tr", *(el("th", h) for h in ("fabric", "GPU class", "free", "live")))
    body = [el("tr", el("td", f.fabric), el("td", f.gpu_class), el("td", f.free_nodes, cls="num"),
               el("td", f.live_nodes, cls="num")) for f in r.free_nodes]
    return el("table", el("thead", head), el("tbody", *body))


STATE_CLASS = {"serving": "good", "healthy": "good", "starting": "warn", "placed": "warn", "parked": "info",
               "unhealthy": "bad", "failed": "bad", "unplaceable": "bad", "stopped": "info", "down": "bad"}


def badge(state: str) -> Safe:
    return el("span", state, cls=f"badge {STATE_CLASS.get(state, 'info')}")


def cached(x: m.ReplicaRow) -> str:
    """`` · 84% cached``: the share of its prompt tokens its engine served from its prefix cache."""
    return f" · {x.cached_tokens / x.prompt_tokens:.0%} cached" if x.prompt_tokens else ""


def models_section(r: m.StatusReport) -> Safe:
    """Every declared model (healthy of wanted, as ``ctl model list``), its replicas under it."""
    replicas: dict[str, list[m.ReplicaRow]] = {}
    for rep in r.replica_list:
        replicas.setdefault(rep.model, []).append(rep)
    summaries = {s.name: s for s in r.model_list}
    names = sorted({*summaries, *replicas})
    if not names:
        return el("p", "no models declared: ", el("code", "llmgw ctl model deploy …"), cls="empty")
    rows = []
    for name in names:
        reps = sorted(replicas.get(name, []), key=lambda x: x.replica_id)
        summary = summaries.get(name)
        state = summary.state if summary is not None else "undeclared"
        healthy = summary.healthy if summary is not None else sum(x.state == "healthy" for x in reps)
        wanted = summary.wanted if summary is not None else len(reps)
        why = (summary.unplaceable or "") if summary is not None else ""
        rows.append(el("tr", el("td", name, cls="model"), el("td", badge(state)),
                       el("td", f"{healthy}/{wanted} healthy", cls="num"),
                       el("td", why, cls="reason"), cls="model-row"))
        for x in reps:
            idle = "idle -" if x.idle_s < 0 else f"idle {duration(x.idle_s)}"
            rows.append(el("tr", el("td", x.replica_id, cls="replica"), el("td", badge(x.state)),
                           el("td", f"{plural(len(x.gpus), 'GPU')} on {', '.join(x.nodes)}", cls="num"),
                           el("td", idle + cached(x), cls="idle"), cls="replica-row"))
    head = el("tr", *(el("th", h) for h in ("model / replica", "state", "healthy / GPUs", "why / idle")))
    return el("table", el("thead", head), el("tbody", *rows))


MAX_NODES_SHOWN = 400  # a node's row per node with samples or bookings, at most; the capacity figures cover all


def booking_bar(holders: Iterable[tuple[str, int]], used: int | None, total: int) -> Safe:
    """A card's memory as SVG: what each replica booked (adjacent ones in alternating shades) on the top
    band, what the engines hold (measured) on the thin band under it; the rest is free."""
    rects = []
    x = 0.0
    for i, (_, mib) in enumerate(holders):
        if mib <= 0 or total <= 0:
            continue
        w = min(max(100 * mib / total, 1.0), 100 - x)
        rects.append(el("rect", cls=f"booked b{i % 2}", x=f"{x:.2f}", y="0", width=f"{w:.2f}", height="7"))
        x += w
    if used is not None and total > 0 and used > 0:
        over = used > sum(mib for _, mib in holders) * (1 + m.OVERBOOK_MARGIN)
        w = min(max(100 * used / total, 1.0), 100.0)
        rects.append(el("rect", cls="inuse over" if over else "inuse", x="0", y="7.5", width=f"{w:.2f}", height="2.5"))
    return el("svg", *rects, cls="bar card", viewBox="0 0 100 10", preserveAspectRatio="none", role="img")


def _used_on(r: m.StatusReport) -> dict[tuple[str, str, int], int]:
    """(replica, node, GPU index) → MiB its engine holds there: its agent's figure for the node, split over
    its GPUs on that node as it booked them. Only where a figure was reported."""
    observed = {x.replica_id: x.observed_memory_mib for x in r.replica_list if x.observed_memory_mib}
    on_node: dict[tuple[str, str], int] = {}
    for b in r.gpu_bookings:
        for rid, mib in b.replicas:
            on_node[(rid, b.node)] = on_node.get((rid, b.node), 0) + mib
    out = {}
    for b in r.gpu_bookings:
        for rid, mib in b.replicas:
            used = observed.get(rid, {}).get(b.node)
            if used and on_node[(rid, b.node)] > 0:
                out[(rid, b.node, b.index)] = round(used * mib / on_node[(rid, b.node)])
    return out


def _bookings(bookings: list[m.GpuBooking], used_on: dict[tuple[str, str, int], int]) -> Safe:
    """A node's booked GPUs: a bar each, and who booked how much (and holds how much, where measured)."""
    rows = []
    for b in sorted(bookings, key=lambda b: b.index):
        used = [used_on.get((rid, b.node, b.index)) for rid, _ in b.replicas]
        known = [u for u in used if u is not None]
        used_total = sum(known) if known else None
        holders = [el("li", el("span", rid, cls="rid"), f" {gib(mib)}",
                       el("span", f" · {gib(u)} used", cls="used") if u is not None else "", title=rid)
                   for (rid, mib), u in zip(b.replicas, used, strict=True)]
        memory = b.memory_mib or b.booked_mib
        head = f"GPU {b.index} · {gib(b.booked_mib)} of {gib(memory)}"
        shared = len(b.replicas) > 1
        title = (f"GPU {b.index} on {b.node}: {plural(len(b.replicas), 'replica')} booked {gib(b.booked_mib)} of "
                 f"{gib(memory)}; {gib(max(memory - b.booked_mib, 0))} free"
                 + (f"; their engines hold {gib(used_total)}" if used_total is not None else ""))
        rows.append(el("div", el("div", head, cls="booking-head"), booking_bar(b.replicas, used_total, memory),
                       el("ul", *holders, cls="holders"),
                       cls="booking shared" if shared else "booking", title=title, data_gpu=f"{b.node}/{b.index}"))
    return join(rows)


GPU_LEGEND = el("div", "a cell per GPU: utilization %, darker is busier ·", el("span", "", cls="swatch held"),
                "held by a replica (named in its tile) ·", el("span", "✕", cls="swatch bad"), "unhealthy",
                cls="legend gpu-legend")
BOOKING_LEGEND = el("div", "a tile per held GPU:", el("span", "", cls="swatch booked"), "booked",
                    el("span", "", cls="swatch inuse"), "held by its engine (measured)",
                    el("span", "", cls="swatch free"), "free", cls="legend")


def gpus_section(r: m.StatusReport) -> Safe:
    """Per node: each GPU's use (a cell), then each booked GPU with who booked how much of it."""
    lost = set(r.lost_nodes)
    booked: dict[str, list[m.GpuBooking]] = {}
    for b in r.gpu_bookings:
        booked.setdefault(b.node, []).append(b)
    if not r.node_gpus and not lost and not booked:
        return el("p", "no GPU samples yet (agents send them with each heartbeat)", cls="empty")
    used_on = _used_on(r) if booked else {}
    holders = {(b.node, b.index): [rid for rid, _ in b.replicas] for b in r.gpu_bookings}
    rows: list[Safe] = [GPU_LEGEND, *([BOOKING_LEGEND] if booked else [])]
    sampled = {n.node for n in r.node_gpus}
    shown = 0
    for n in r.node_gpus:
        cells = []
        for g in n.gpus:
            u = g.utilization_pct
            level = "unknown" if u is None else f"u{min(10, (u + 5) // 10)}"
            mem = "-" if g.memory_used_mib is None or not g.memory_total_mib else \
                f"{gib(g.memory_used_mib)} / {gib(g.memory_total_mib)}"
            held = holders.get((n.node, g.index), [])
            title = (f"GPU {g.index}: {'held by ' + ', '.join(held) if held else 'free'}; "
                     f"{'-' if u is None else f'{u}%'} busy, {mem}, "
                     f"{'-' if g.temperature_c is None else f'{g.temperature_c}°C'}, "
                     f"{'-' if g.power_w is None else f'{g.power_w:.0f} W'}")
            bad = n.unhealthy.get(g.index)
            if bad is not None:  # an XID'd GPU is not an idle one: marked, with why
                cells.append(el("span", "✕", cls="gpu bad", title=f"GPU {g.index} UNHEALTHY: {bad}"))
                continue
            cells.append(el("span", "-" if u is None else u, cls=f"gpu {level}" + (" held" if held else ""),
                            title=title, data_held=",".join(held) or None))
        rows.append(el("div", el("span", n.node, cls="node"), el("span", n.gpu_class, cls="cls"),
                       el("span", *cells, cls="cells"), cls="node-row"))
        if n.node in booked:
            rows.append(el("div", _bookings(booked[n.node], used_on), cls="bookings"))
        shown += 1
    for name in sorted(set(booked) - sampled - lost):  # booked, but no heartbeat sample yet
        if shown >= MAX_NODES_SHOWN:
            break
        rows.append(el("div", el("span", name, cls="node"), el("span", booked[name][0].gpu_class, cls="cls"),
                       el("span", "no samples yet", cls="cells empty"), cls="node-row"))
        rows.append(el("div", _bookings(booked[name], used_on), cls="bookings"))
        shown += 1
    for name in sorted(lost):
        rows.append(el("div", el("span", name, cls="node"), el("span", "lost", cls="badge bad"), cls="node-row"))
    more = r.nodes - len(lost) - shown
    if more > 0:
        rows.append(el("p", f"… and {plural(more, 'more node')} (all are in the capacity figures)", cls="empty"))
    return join(rows)


BAD_MODEL_STATES = ("failing", "failed", "unplaceable", "unhealthy")


def attention_section(r: m.StatusReport, *, tenants: bool = True) -> Safe:
    """What needs someone, in one short list at the top of the page (never below the fold): lost nodes,
    unhealthy GPUs, models that do not serve, keys at 80 % of their tokens for today; first of all, a control
    plane that is down (a dashboard outside ``llmgw up`` while it is away, or a moment inside its gap)."""
    items: list[Safe] = [el("li", f"control plane down since {clock(r.control_plane_since)} UTC: nothing serves and "
                                  "no GPU-hours count until it starts again", cls="bad")] if r.control_plane == "down" else []
    items += [el("li", f"node {n} lost", cls="bad") for n in sorted(r.lost_nodes)]
    for n in r.node_gpus:
        items += [el("li", f"{n.node} GPU {i} unhealthy: {why}", cls="bad") for i, why in sorted(n.unhealthy.items())]
    for s in r.model_list:
        if s.state in BAD_MODEL_STATES:
            items.append(el("li", f"model {s.name} {s.state}" + (f": {s.unplaceable}" if s.unplaceable else ""),
                            cls="bad"))
    if tenants:
        items += [el("li", f"key {k.name} ({k.tenant or '-'}) at {k.tokens_today:,} of {k.tokens_per_day:,} tokens "
                           "today", cls="warn") for k in r.near_limits]
    elif r.near_limits:
        items.append(el("li", f"{plural(len(r.near_limits), 'key')} at 80 % or more of its tokens for today "
                              "(log in with an admin key to see which)", cls="warn"))
    if not items:
        return el("p", "nothing needs attention", cls="attention-ok")
    shown, more = items[:6], len(items) - 6
    return el("ul", *shown, *([el("li", f"… and {more} more", cls="more")] if more > 0 else []), cls="attention")


def timeline_entry(event: m.Event) -> tuple[str, str, str]:
    """(severity, subject, what happened) of an event, for the timeline."""
    match event:
        case m.NodeInventoryReported(node=node, gpus=gpus, fabric=fabric):
            kinds = Counter(g.gpu_class for g in gpus)
            bad = sum(not g.healthy for g in gpus)
            what = ", ".join(f"{n} × {k}" for k, n in sorted(kinds.items())) or "no GPUs"
            return ("warn" if bad else "info", node,
                    f"reported {what} on fabric {fabric}" + (f", {bad} unhealthy" if bad else ""))
        case m.GpuHealthChanged(node=node, gpu_index=i, healthy=ok, reasons=why):
            return ("good" if ok else "bad", node,
                    f"GPU {i} healthy again" if ok and not why else f"GPU {i} {'healthy' if ok else 'unhealthy'}: "
                    + "; ".join(why))
        case m.NodeLost(node=node, timeout_s=timeout):
            return "bad", node, f"lost: no heartbeat for {timeout:g}s"
        case m.NodeReturned(node=node):
            return "good", node, "returned"
        case m.NodeRetired(node=node):
            return "info", node, "retired by an operator"
        case m.NodeCordoned(node=node, reason=why, drain=drain, by=by):
            if by == "quarantine":
                return "bad", node, f"quarantined: {why.removeprefix('quarantine: ')}"
            return "warn", node, f"{'draining' if drain else 'cordoned'}" + (f": {why}" if why else "")
        case m.NodeUncordoned(node=node):
            return "good", node, "uncordoned: takes new replicas again"
        case m.ModelDeclared(spec=s):
            return ("info", s.name, f"declared: {s.source} {s.precision}, tp {s.tp} × pp {s.pp} on {s.gpu_class}, "
                                    f"{plural(s.replicas, 'replica')}")
        case m.ModelScaled(name=name, replicas=n):
            return "info", name, f"scaled to {plural(n, 'replica')}"
        case m.ModelAutoscaled(name=name, replicas=n, reason=why):
            return "info", name, f"autoscaled to {plural(n, 'replica')}" + (f": {why}" if why else "")
        case m.ModelRemoved(name=name):
            return "info", name, "removed"
        case m.ModelUnplaceable(name=name, reason=why):
            return "bad", name, f"unplaceable: {why}"
        case m.ReplicaPlaced(replica_id=rid, nodes=nodes, gpus=gpus, fabric=fabric):
            return "info", rid, f"placed on {plural(len(gpus), 'GPU')} of {', '.join(nodes)}" + (
                f" (fabric {fabric})" if fabric else "")
        case m.ReplicaStateChanged(replica_id=rid, node=node, state=state, detail=detail):
            sev = STATE_CLASS.get(state, "info")
            return sev, rid, f"{state} on {node}" + (f": {detail}" if detail else "")
        case m.ReplicaStopped(replica_id=rid, reason=why):
            return "info", rid, f"stopped: {why}"
        case m.ControlPlaneStopped(reason=why):
            return "bad", "control plane", f"stopped ({why or 'no reason given'}): nothing serves until it starts again"
        case m.ControlPlaneStarted(last_seen=seen):
            return "good", "control plane", "started" + (
                f"; down since {clock(seen)} UTC (a stop nothing recorded)" if seen is not None else "")
    return "info", "", type(event).__name__


def events_section(events: Iterable[m.Event]) -> Safe:
    rows = []
    for e in events:
        sev, who, what = timeline_entry(e)
        rows.append(el("li", el("time", clock(e.at), datetime=e.at.isoformat()), el("span", type(e).__name__, cls="kind"),
                       el("span", who, cls="who"), el("span", what, cls="what"), cls=f"event {sev}"))
    return el("ol", *rows, cls="timeline") if rows else el("p", "no events yet", cls="empty")


def summary_section(r: m.StatusReport) -> Safe:
    by_state = ", ".join(f"{n} {s}" for s, n in r.replicas_by_state.items()) or "none"
    parts = [plural(r.nodes, "node"), f"{len(r.lost_nodes)} lost", plural(r.models, "model"),
             f"{plural(r.replicas, 'replica')} ({by_state})"]
    if r.unprojected_events:
        parts.append(f"{plural(r.unprojected_events, 'event')} not projected")
    return el("p", " · ".join(parts), cls="summary")


def conn_section(ok: bool, why: str, at: float | None) -> Safe:
    when = datetime.fromtimestamp(at, UTC) if at else None
    if ok:
        return el("span", f"live · {clock(when)} UTC", cls="conn live")
    last = f"; showing what it said at {clock(when)} UTC" if when else ""
    return el("span", f"reconnecting: {why}{last}", cls="conn reconnecting")


TENANTS_HIDDEN = el("p", "tenants' names and usage are an admin's: log in with an admin key (",
                    el("code", "llmgw ctl key create NAME --scope admin"), ")", cls="empty")


def render(report: m.StatusReport | None, events: Iterable[m.Event], *, ok: bool, why: str,
           at: float | None, tenants: bool = True) -> dict[str, str]:
    """Every section of the page as escaped HTML, by element id; ``tenants``: with their names and usage."""
    out: dict[str, str] = {"conn": conn_section(ok, why, at), "events": events_section(events)}
    if report is None:
        waiting = el("p", "waiting for the projector…", cls="empty")
        out |= {k: waiting for k in ("summary", "attention", "capacity", "fabrics", "tenants", "models", "gpus")}
        return out
    out |= {"summary": summary_section(report), "attention": attention_section(report, tenants=tenants),
            "capacity": capacity_section(report), "fabrics": fabrics_section(report),
            "tenants": tenants_section(report) if tenants else TENANTS_HIDDEN, "models": models_section(report),
            "gpus": gpus_section(report)}
    return out


PAGE_TITLES = {"capacity": "Capacity per GPU class", "fabrics": "Free whole nodes per fabric",
               "tenants": "Usage per tenant", "models": "Models and replicas", "gpus": "GPUs per node: use and bookings",
               "events": "Recent events"}


def page(sections: dict[str, str], *, logout: bool = False) -> str:
    """The whole page, server-rendered: it reads right before (and without) its script."""
    def panel(k: str) -> Safe:
        return el("section", el("h2", PAGE_TITLES[k]), el("div", Safe(sections[k]), id=k), cls=f"panel {k}")

    # Three columns, each as long as what it holds (none scrolls inside the page): the fleet's
    # figures, the models and what happened to them, the GPUs.
    blocks = [el("div", *(panel(k) for k in ks), cls=f"col {name}") for name, ks in (
        ("fleet", ("capacity", "tenants", "fabrics")), ("work", ("models", "events")), ("cards", ("gpus",)))]
    leave = el("form", Safe('<button type="submit">log out</button>'), method="post", action="logout") if logout else ""
    return "<!doctype html>" + el(
        "html",
        el("head", Safe('<meta charset="utf-8">'), Safe('<meta name="viewport" content="width=device-width">'),
           el("title", "llmgw dashboard"), Safe('<link rel="stylesheet" href="static/dashboard.css">'),
           Safe('<script src="static/dashboard.js" defer></script>')),
        el("body", el("header", el("h1", "llmgw"), el("div", Safe(sections["conn"]), id="conn"),
                      el("div", Safe(sections["summary"]), id="summary"), leave),
           el("div", Safe(sections["attention"]), id="attention"),
           el("main", *blocks)),
        lang="en")


def login_page(problem: str = "") -> str:
    form = el("form", el("label", "API key ", Safe('<input type="password" name="key" autofocus required>')),
              Safe('<button type="submit">open</button>'), method="post", action="login")
    note = el("p", problem, cls="error") if problem else ""
    return "<!doctype html>" + el("html", el("head", Safe('<meta charset="utf-8">'), el("title", "llmgw dashboard"),
                                             Safe('<link rel="stylesheet" href="static/dashboard.css">')),
                                  el("body", el("main", el("h1", "llmgw"), note, form, cls="login")), lang="en")


# --- the server ------------------------------------------------------------------------------------
