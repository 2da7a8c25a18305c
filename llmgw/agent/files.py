"""What a node holds on disk: its model stores scanned into ``HeldSource`` entries, with digests.

Two stores: the Hugging Face cache (``huggingface_hub.scan_cache_dir``: a file's digest is its
blob's name, the sha256 of an LFS file or the git sha1 of a small one) and the agent's models
directory (``LLMGW_MODELS_DIR``): ``Org__Name/`` folders of GGUF files or checkpoints, where a
GGUF's sha256 is computed once and kept beside it (``NAME.gguf.sha256``, as ``sha256sum`` writes
it) and trusted while it is newer than the file. A file still being written (``*.incomplete``,
``*.part``) makes its source partial; a checkpoint whose ``*.index.json`` names a shard that is not
there is partial too. Nothing here publishes: ``llmgw.agent.downloads`` does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from llmgw import messages as m

log = logging.getLogger(__name__)

DIGEST_SUFFIX = ".sha256"
PARTIAL_SUFFIXES = (".incomplete", ".part")
WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
REPORT_MAX_BYTES = 512 * 1024  # a report's JSON: well under NATS's default 1 MiB payload
HASH_CHUNK = 8 << 20


def source_dir_name(source: str) -> str:
    """A repository id as its folder in the models directory: ``Org/Name`` → ``Org__Name``."""
    return source.replace("/", "__")


def digest_of_blob(name: str) -> str:
    """A cache blob's name as a digest: 64 hex digits are a sha256 (LFS), 40 a git sha1; else ""."""
    if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
        return f"sha256:{name}"
    if len(name) == 40 and all(c in "0123456789abcdef" for c in name):
        return f"git-sha1:{name}"
    return ""


def sha256_file(path: Path) -> str:
    """The file's sha256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def git_sha1_file(path: Path) -> str:
    """The file's git blob id (what the hub names a small file by)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_matches(path: Path, digest: str) -> bool:
    """Whether a file's content is what ``digest`` says ("sha256:…" or "git-sha1:…")."""
    kind, _, want = digest.partition(":")
    if kind == "sha256":
        return sha256_file(path) == want
    if kind == "git-sha1":
        return git_sha1_file(path) == want
    return False


def kept_digest(path: Path) -> str:
    """The sha256 kept beside a file, while it is newer than the file; "" when there is none yet."""
    side = path.with_name(path.name + DIGEST_SUFFIX)
    try:
        if side.stat().st_mtime_ns < path.stat().st_mtime_ns:
            return ""
        hexd = side.read_text().split()[0]
    except (OSError, IndexError):
        return ""
    return f"sha256:{hexd}" if len(hexd) == 64 else ""


def keep_digest(path: Path, hexd: str | None = None) -> str:
    """Compute (unless given) a file's sha256 and keep it beside the file; the digest."""
    hexd = hexd or sha256_file(path)
    side = path.with_name(path.name + DIGEST_SUFFIX)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{hexd}  {path.name}\n")
    tmp.replace(side)
    return f"sha256:{hexd}"


def _when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _shards_missing(root: Path, present: set[str]) -> bool:
    """Whether an ``*.index.json`` here names a weight shard that is not among ``present``."""
    for index in (p for p in present if p.endswith(".index.json")):
        try:
            weight_map = json.loads((root / index).read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            return True  # an index that cannot be read: nothing says the shards are all there
        if isinstance(weight_map, dict) and not set(map(str, weight_map.values())) <= present:
            return True
    return False


# --- the models directory ----------------------------------------------------------------


def scan_models_dir(models_dir: Path, used: Mapping[str, datetime] | None = None) -> list[m.HeldSource]:
    """Every ``Org__Name`` folder of the models directory as a source (its GGUFs, or its checkpoint)."""
    out: list[m.HeldSource] = []
    if not models_dir.is_dir():
        return out
    for folder in sorted(p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not any(p.suffix == ".gguf" or p.name == "config.json" or p.name.endswith(PARTIAL_SUFFIXES)
                   or p.name == ".cache" for p in folder.iterdir()):
            continue  # not a model's folder (a Hugging Face cache kept here, notes)
        source = folder.name.replace("__", "/")
        files: list[m.HeldFile] = []
        partial = False
        newest = 0.0
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if not path.is_file() or rel.endswith(DIGEST_SUFFIX) or rel.endswith(".tmp"):
                continue
            if rel.startswith(".cache/"):  # huggingface_hub's local-dir bookkeeping
                partial = partial or rel.endswith(PARTIAL_SUFFIXES)
                continue
            st = path.stat()
            if rel.endswith(PARTIAL_SUFFIXES):
                partial = True
                files.append(m.HeldFile(path=rel.removesuffix(".incomplete").removesuffix(".part"),
                                        size=st.st_size, complete=False))
                continue
            newest = max(newest, st.st_mtime)  # not atime: hashing a file reads it, and that is no use
            digest = kept_digest(path) if rel.endswith(".gguf") else ""
            files.append(m.HeldFile(path=rel, size=st.st_size, digest=digest))
        if not files:
            continue
        present = {f.path for f in files if f.complete}
        complete = not partial and not _shards_missing(folder, present)
        last = (used or {}).get(source) or (_when(newest) if newest else None)
        out.append(m.HeldSource(source=source, store="models-dir", files=tuple(files), complete=complete,
                                size=sum(f.size for f in files), last_used=last))
    return out


def gguf_without_digest(models_dir: Path) -> list[Path]:
    """The GGUF files of the models directory whose sha256 is not kept yet."""
    if not models_dir.is_dir():
        return []
    return [p for p in sorted(models_dir.glob("*/**/*.gguf")) if ".cache" not in p.parts and not kept_digest(p)]


# --- the Hugging Face cache --------------------------------------------------------------


def scan_hf_cache(cache_dir: Path, used: Mapping[str, datetime] | None = None) -> list[m.HeldSource]:
    """Every model repository in the Hugging Face cache, at its most recently written revision."""
    # Imported here: huggingface_hub is slow to import, and an agent without a cache never pays it.
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    if not cache_dir.is_dir():
        return []
    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    out: list[m.HeldSource] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        files = tuple(m.HeldFile(path=f.file_path.relative_to(rev.snapshot_path).as_posix(),
                                 size=f.size_on_disk, digest=digest_of_blob(f.blob_path.name))
                      for f in sorted(rev.files, key=lambda f: str(f.file_path)))
        partial = any(p.name.endswith(PARTIAL_SUFFIXES) for p in (repo.repo_path / "blobs").glob("*"))
        complete = not partial and not _shards_missing(rev.snapshot_path, {f.path for f in files})
        last = (used or {}).get(repo.repo_id) or _when(repo.last_accessed)
        out.append(m.HeldSource(source=repo.repo_id, store="hf-cache", revision=rev.commit_hash, files=files,
                                complete=complete, size=sum(f.size for f in files), last_used=last))
    return out


# --- one report --------------------------------------------------------------------------


@dataclass(frozen=True)
class Disk:
    budget: int
    free: int


def _largest_files(held: m.HeldSource) -> m.HeldSource:
    if len(held.files) <= m.MAX_HELD_FILES:
        return held
    # The weights matter to placement; configs and tokenizers are small and many.
    files = sorted(held.files, key=lambda f: (not f.path.endswith(WEIGHTS), -f.size))[:m.MAX_HELD_FILES]
    return msgspec.structs.replace(held, files=tuple(sorted(files, key=lambda f: f.path)))


def report(node: str, boot_id: str, sources: Iterable[m.HeldSource], disk: Disk, now: datetime) -> m.NodeFilesReported:
    """A node's files as one event inside its bounds: the most recently used sources first, the rest
    left out (``truncated``) when there are more than a report carries or its JSON would pass
    ``REPORT_MAX_BYTES``; each source's largest files when it has more than ``MAX_HELD_FILES``."""
    floor = datetime.min.replace(tzinfo=UTC)
    ordered = sorted((_largest_files(h) for h in sources), key=lambda h: h.last_used or floor, reverse=True)
    kept = ordered[:m.MAX_HELD_SOURCES]
    event = m.NodeFilesReported(at=now, node=node, boot_id=boot_id, sources=tuple(kept), disk_budget=disk.budget,
                                disk_free=disk.free, truncated=len(kept) < len(ordered))
    while kept and len(m.encode(event)) > REPORT_MAX_BYTES:
        kept = kept[:max(1, len(kept) * 3 // 4)] if len(kept) > 1 else []
        event = msgspec.structs.replace(event, sources=tuple(kept), truncated=True)
    return event


def disk_free(*paths: Path) -> int:
    """Bytes free on the disk under the first of these that exists (0: none does)."""
    for p in paths:
        probe = p
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return 0
