"""How fast the control loop closes, from the events' own timestamps, on ``llmgw up --simulate``.

    python benchmarks/control_loop.py [--rounds 3]

Each round deploys a model, waits for it to serve, injects XID 79 under it and
waits for the replacement to serve. Prints medians of: declared → placed,
placed → healthy (fake engine start + health check), XID → stopped, and
XID → replacement healthy. Fake engines start in well under a second; a real
vLLM adds its model load time to "placed → healthy".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLMGW = str(Path(sys.executable).parent / "llmgw")
FLEET = """
[[nodes]]
name = "gpu-a"
fabric = "ib-a"
gpu_class = "A100-40GB"
gpu_count = 8
gpu_memory_mib = 40960
"""


def cli(url: str, *args: str) -> str:
    env = dict(os.environ, LLMGW_NATS_URL=url, LLMGW_MODELS_DIR=str(ROOT / "examples" / "models"))
    r = subprocess.run([LLMGW, *args], capture_output=True, text=True, env=env, timeout=60, check=True)
    return r.stdout


def events(url: str, stream: str) -> list[dict[str, Any]]:
    return [json.loads(x)["event"] for x in cli(url, "replay", "--stream", stream, "--json").splitlines() if x.strip()]


def at(e: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(e["at"])


def wait(url: str, pred: Any, within_s: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        evs = events(url, "control")
        if pred(evs):
            return evs
        time.sleep(0.5)
    raise SystemExit("timed out waiting for the control plane")


def healthy(evs: list[dict[str, Any]], rid: str) -> dict[str, Any] | None:
    return next((e for e in evs if e["type"] == "ReplicaStateChanged" and e["replica_id"] == rid and e["state"] == "healthy"), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-loop-"))
    (tmp / "fleet.toml").write_text(FLEET)
    up = subprocess.Popen([LLMGW, "up", "--simulate", str(tmp / "fleet.toml"), "--data-dir", str(tmp / "data"), "--port", "0",
                           "--router-listen", "127.0.0.1:0", "--heartbeat-s", "1", "--no-example", "--insecure"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    figures: dict[str, list[float]] = {"declared → placed": [], "placed → healthy": [], "XID → stopped": [],
                                       "XID → replacement healthy": []}
    try:
        assert up.stdout is not None
        match = re.match(r"nats: (\S+)", up.stdout.readline())
        assert match
        url = match.group(1)
        for i in range(args.rounds):
            name = f"m{i}"
            for _ in range(60):
                if json.loads(cli(url, "ctl", "model", "plan", "Qwen/Qwen2.5-14B-Instruct", "--context", "8192", "--json"))["candidates"]:
                    break
                time.sleep(0.5)
            cli(url, "ctl", "model", "deploy", name, "Qwen/Qwen2.5-14B-Instruct", "--from-plan", "--candidate", "1", "--context", "8192")
            evs = wait(url, lambda e, n=name: healthy(e, f"{n}-r1") is not None)
            declared = next(e for e in evs if e["type"] == "ModelDeclared" and e["spec"]["name"] == name)
            placed = next(e for e in evs if e["type"] == "ReplicaPlaced" and e["replica_id"] == f"{name}-r1")
            figures["declared → placed"].append((at(placed) - at(declared)).total_seconds())
            figures["placed → healthy"].append((at(healthy(evs, f"{name}-r1") or {}) - at(placed)).total_seconds())
            gpu = placed["gpus"][0]
            cli(url, "agent", "fault", gpu["node"], str(gpu["index"]), "xid=79")
            evs = wait(url, lambda e, n=name: healthy(e, f"{n}-r2") is not None)
            xid = [e for e in events(url, "fleet") if e["type"] == "GpuHealthChanged"][-1]
            stopped = next(e for e in evs if e["type"] == "ReplicaStopped" and e["replica_id"] == f"{name}-r1")
            figures["XID → stopped"].append((at(stopped) - at(xid)).total_seconds())
            figures["XID → replacement healthy"].append((at(healthy(evs, f"{name}-r2") or {}) - at(xid)).total_seconds())
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(30)
    print(f"llmgw up --simulate (1 node × 8 A100-40GB, fake engines); medians of {args.rounds} rounds")
    for k, v in figures.items():
        print(f"{k:<28} {statistics.median(v) * 1e3:8.0f} ms   (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f})")


if __name__ == "__main__":
    main()
