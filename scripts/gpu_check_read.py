"""On the GPU machine: what the real-NVML agent put on the bus (inventory, health, the latest heartbeat's samples)."""
import asyncio
import json

import msgspec

from llmgw import messages as m
from llmgw import subjects
from llmgw.bus import Bus
from llmgw.config import Settings


async def main() -> None:
    bus = await Bus.connect(Settings(nats_url="nats://127.0.0.1:4222"), "devcheck")
    out = {}
    for stream in (subjects.STREAM_FLEET, subjects.STREAM_HEARTBEAT, subjects.STREAM_CONTROL):
        last = await bus.stream_last_seq(stream)
        evs = []
        if last:
            async for batch in bus.reader(stream, 1, stop_at=last).batches():
                for r in batch:
                    try:
                        evs.append(msgspec.to_builtins(m.decode_event(r.data)))
                    except Exception as e:
                        evs.append({"undecodable": str(e), "raw": r.data[:300].decode(errors="replace")})
        out[stream] = evs[-6:]
    print(json.dumps(out, indent=1, default=str))
    await bus.close()

asyncio.run(main())
