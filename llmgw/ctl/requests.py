"""``ctl request ID``: one request's line in the routers' access logs (``--access-log``).

Where it looks: the files given (``--log FILE``), else every ``*access*.log*`` in the data
directory's ``logs/`` (``llmgw up`` writes ``router-access.log`` there; logrotate's
``.1`` and ``.2.gz`` beside it are read too), newest first. Each file is read through
once, a line at a time; only a line holding the id as a JSON string is decoded, so a large
log costs its read and little more. Every matching line is returned: a client that
sent the same id twice finds both.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import msgspec

from llmgw import messages as m
from llmgw.errors import LlmgwError

ACCESS_GLOB = "*access*.log*"
_LINE = msgspec.json.Decoder(m.AccessLine)


def access_logs(data_dir: Path) -> list[Path]:
    """The access logs of a data directory (``logs/``), newest first."""
    found = [p for p in (data_dir / "logs").glob(ACCESS_GLOB) if p.is_file()]
    return sorted(found, key=lambda p: (-p.stat().st_mtime, p.name))  # same time: .log before .log.1


def find_request(request_id: str, paths: list[Path]) -> list[tuple[Path, m.AccessLine]]:
    """Every line of ``paths`` whose id is ``request_id``, with its file, in the order found."""
    if not re.match(m.REQUEST_ID_PATTERN, request_id):
        raise LlmgwError(f"{request_id!r} is not a request id (1 to {m.REQUEST_ID_MAX} of letters, digits and "
                         "._:/+=@-); copy it from an answer's x-request-id header or its error's request_id")
    needle = b'"' + request_id.encode() + b'"'
    found: list[tuple[Path, m.AccessLine]] = []
    for path in paths:
        try:
            f = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115
            with f:
                for raw in f:
                    if needle in raw:
                        try:
                            line = _LINE.decode(raw)
                        except msgspec.DecodeError:
                            continue  # a line cut short (the disk filled): not the request's answer
                        if line.id == request_id:
                            found.append((path, line))
        except (OSError, EOFError) as e:
            raise LlmgwError(f"cannot read the access log {path} ({getattr(e, 'strerror', None) or e})") from e
    return found
