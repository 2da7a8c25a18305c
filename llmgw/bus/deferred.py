"""Imported first by ``llmgw.bus``: nats-py without aiohttp until a ``ws://`` URL needs it.

``nats.aio.transport`` imports aiohttp (and multidict) at module level, for
websocket connections only, and falls back to ``None`` when they are missing.
aiohttp's import builds TLS contexts and costs about as much as the rest of
nats-py, in every ``llmgw ctl`` command that never opens a websocket. So
nats-py is imported here with those two hidden (its fallback applies), and
they are unhidden at once: anything importing aiohttp later (the router) gets
the real module. ``websockets()`` hands nats-py the real modules when a URL is
``ws://`` or ``wss://``. (The standard library's LazyLoader cannot do this: the
``import`` statement itself reads ``__spec__`` and so loads the module.)
These are nats-py internals, pinned with its minor version; tests/test_frame_parser.py
guards them.
"""

from __future__ import annotations

import sys

DEFERRED = ("aiohttp", "multidict")


def _import_nats_transport() -> None:
    hidden = [name for name in DEFERRED if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment] # `import name` raises ImportError
    try:
        import nats.aio.transport  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def websockets() -> None:
    """Give nats-py the websocket transport's modules (before connecting to a ``ws://`` URL)."""
    import nats.aio.transport as transport

    if transport.aiohttp is None:
        import aiohttp
        import multidict

        transport.aiohttp, transport.multidict = aiohttp, multidict


_import_nats_transport()
