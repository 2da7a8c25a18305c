"""Which node holds which model files: the fold of ``NodeFilesReported`` and its downloads, and the
queries over it (who holds a spec's files, how much a download would be).

A node's report replaces what was known of its disk; a download in flight is kept by (node,
source) until it finishes; an eviction takes the source off that node at once (its next report
says the same). Pure: no clock, no I/O; ``apply`` in ``llmgw.fleet.state`` calls ``fold_files``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from llmgw import messages as m

CHECKPOINT_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")  # what vLLM loads; a GGUF is one file, named
# What an agent's "starting" report says while it fetches a replica's files before its engine starts:
# the cold-start ledger's download phase ends at the next "starting" (the engine's own).
FETCHING_DETAIL = "fetching the files of "
FilesEvent = m.NodeFilesReported | m.DownloadProgressed | m.DownloadFinished | m.FilesEvicted


@dataclass
class NodeFiles:
    """What one node's agent last said its disk holds."""

    sources: dict[str, list[m.HeldSource]] = field(default_factory=dict)  # source → per store
    disk_budget: int = 0
    disk_free: int = 0
    at: datetime | None = None
    truncated: bool = False


def fold_files(state_files: dict[str, NodeFiles], downloads: dict[str, dict[str, m.DownloadProgressed]],
               finished: dict[str, dict[str, m.DownloadFinished]], event: FilesEvent) -> None:
    """Fold one files event into the state's parts that hold them."""
    match event:
        case m.NodeFilesReported():
            sources: dict[str, list[m.HeldSource]] = {}
            for held in event.sources:
                sources.setdefault(held.source, []).append(held)
            state_files[event.node] = NodeFiles(sources=sources, disk_budget=event.disk_budget,
                                                disk_free=event.disk_free, at=event.at, truncated=event.truncated)
        case m.DownloadProgressed():
            downloads.setdefault(event.node, {})[event.source] = event
        case m.DownloadFinished():
            on_node = downloads.get(event.node)
            if on_node is not None:
                on_node.pop(event.source, None)
                if not on_node:
                    del downloads[event.node]
            finished.setdefault(event.node, {})[event.source] = event
        case m.FilesEvicted():
            nf = state_files.get(event.node)
            if nf is not None:
                kept = [h for h in nf.sources.get(event.source, []) if h.store != event.store]
                if kept:
                    nf.sources[event.source] = kept
                else:
                    nf.sources.pop(event.source, None)


def wanted_file(spec: m.ModelSpec) -> str | None:
    """The one file a spec serves from (a GGUF's name), or None for a whole checkpoint."""
    return _name(spec.file) if spec.file else None


def _name(path: str) -> str:
    """A path's last part (PurePosixPath(path).name without building one: placement asks this per node)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def held_complete(held: Iterable[m.HeldSource], spec: m.ModelSpec) -> bool:
    """Whether one of these (a node's entries for the spec's source) holds what the spec serves, complete."""
    file = wanted_file(spec)
    for h in held:
        if file is not None:
            if any(f.complete and _name(f.path) == file for f in h.files):
                return True
        elif h.complete and any(f.path.endswith(CHECKPOINT_WEIGHTS) for f in h.files):
            return True
    return False


def holders(files: Mapping[str, NodeFiles], spec: m.ModelSpec) -> set[str]:
    """The nodes whose disk holds a spec's files, complete (as their agents last reported)."""
    return {node for node, nf in files.items() if (held := nf.sources.get(spec.source)) and held_complete(held, spec)}


def by_source(files: Mapping[str, NodeFiles]) -> dict[str, list[tuple[str, list[m.HeldSource]]]]:
    """Source → (node, what it holds of it): built once, so that each spec's holders are found without a
    walk over every node (``holders_of``)."""
    out: dict[str, list[tuple[str, list[m.HeldSource]]]] = {}
    for node, nf in files.items():
        for source, held in nf.sources.items():
            out.setdefault(source, []).append((node, held))
    return out


def holders_of(index: Mapping[str, list[tuple[str, list[m.HeldSource]]]], spec: m.ModelSpec) -> set[str]:
    """``holders`` over a ``by_source`` index."""
    return {node for node, held in index.get(spec.source, ()) if held_complete(held, spec)}


def expected_bytes(files: Mapping[str, NodeFiles], spec: m.ModelSpec) -> int:
    """How much a download of a spec's files is, from any node that holds them complete; 0: none knows."""
    return expected_bytes_of(by_source(files), spec)


def expected_bytes_of(index: Mapping[str, list[tuple[str, list[m.HeldSource]]]], spec: m.ModelSpec) -> int:
    """``expected_bytes`` over a ``by_source`` index."""
    file = wanted_file(spec)
    best = 0
    for _, held in index.get(spec.source, ()):
        for h in held:
            if file is not None:
                best = max([best, *(f.size for f in h.files if f.complete and _name(f.path) == file)])
            elif held_complete([h], spec):
                best = max(best, h.size)
    return best


def download_rate(finished: Mapping[str, Mapping[str, m.DownloadFinished]]) -> float:
    """Bytes per second of the fleet's verified downloads so far (their bytes over their seconds); 0: none."""
    size = seconds = 0.0
    for on_node in finished.values():
        for d in on_node.values():
            if d.ok and d.seconds > 0 and d.size > 0:
                size, seconds = size + d.size, seconds + d.seconds
    return size / seconds if seconds else 0.0


def fetch_s(files: Mapping[str, NodeFiles], downloaded: Mapping[str, Mapping[str, m.DownloadFinished]],
            spec: m.ModelSpec, nodes: Iterable[str]) -> float:
    """Seconds a replica placed on these nodes spends fetching its files first, at the fleet's recorded
    download rate (``download_rate``); 0 where each node holds them, or nothing was recorded to say."""
    if not files or set(nodes) <= holders(files, spec):
        return 0.0
    rate, size = download_rate(downloaded), expected_bytes(files, spec)
    return size / rate if rate > 0 and size > 0 else 0.0


def gib(n: int) -> str:
    """Bytes for a person: "13.4 GiB", "512.0 MiB", "146.5 KiB"."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def where_files_are(files: Mapping[str, NodeFiles], spec: m.ModelSpec, nodes: Iterable[str] | None = None) -> str:
    """A clause for a person: on how many nodes a spec's files are, and the download otherwise."""
    held = holders(files, spec)
    if nodes is not None:
        held &= set(nodes)
    size = expected_bytes(files, spec)
    if held:
        return f"files on {len(held)} node{'s' if len(held) != 1 else ''} ({', '.join(sorted(held)[:4])}{'…' if len(held) > 4 else ''})"
    return "files on no node: a placement downloads them first" + (f" ({gib(size)})" if size else "")
