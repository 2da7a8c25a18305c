"""A 300-node fleet, 1,000 models and 10,000 keys on one bus: what nats-server holds, and how long each takes.

Starts ``llmgw up --simulate`` on a generated fleet of ``--nodes`` nodes (8 GPUs each, three GPU
classes, ten fabrics; every node a simulated agent in one process, as ``up`` runs them), with
``--routers`` routers in all (up's and more ``llmgw router`` processes on the same bus), then:

1. **ctl status** on the idle fleet: the median of 5 ``llmgw ctl status --json``.
2. **apply**: ``llmgw apply`` of ``--models`` models: ``--placed`` of them one GPU each, the rest
   a whole node of H200s each, which only ten nodes have: ten more are placed and the scheduler
   says of every other why it waits (a fleet with more models than cards; a replica placed is a
   fake-engine process of ~40 MB here, so 1,000 placed would not fit this box's memory). The
   command's wall time, then until the agents reported every placed replica healthy.
3. **keys**: ``llmgw ctl key import`` of ``--keys`` keys; from the command's start until every
   router takes the last key of the file (``GET /v1/models`` with its secret answers anything but 401).
4. **ctl status** again, with all of that stored.

All along, nats-server's resident memory is sampled every 0.2 s (its peak is printed), and at the
end the control stream's consumers are counted with their filters. Goals (issue 45): nats-server
RSS under 1 GB, ``ctl status`` under 1 s, ``apply`` of 1,000 models under 30 s, 10,000 keys visible
to every router within 10 s. The load average is printed before and after (the machine is shared).

    python benchmarks/scale.py [--nodes 300] [--models 1000] [--placed 40] [--keys 10000] [--routers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmgw.bus.server import free_port

ROOT = Path(__file__).resolve().parent.parent
LLMGW = [sys.executable, "-m", "llmgw"]
SCARCE = 10  # nodes of H200s, the class most models ask for: one model each fits, the rest wait, unplaceable
CLASSES = (("H100-80GB", 81559), ("A100-40GB", 40960), ("L40S-48GB", 46068))
SOURCES = ("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct", "google/gemma-2-9b-it")


def write_fleet(path: Path, nodes: int) -> None:
    with path.open("w") as f:
        for i in range(nodes):
            gpu_class, mib = ("H200-141GB", 143771) if i < SCARCE else CLASSES[i % len(CLASSES)]
            f.write(f'[[nodes]]\nname = "node-{i:04d}"\nfabric = "ib-{i % 10}"\ngpu_class = "{gpu_class}"\n'
                    f"gpu_count = 8\ngpu_memory_mib = {mib}\n\n")


def write_models(path: Path, models: int, placed: int) -> None:
    with path.open("w") as f:
        for i in range(models):
            where = "tp = 1\n" if i < placed else 'tp = 8\ngpu_class = "H200-141GB"\nexclusive = true\n'
            f.write(f'[[model]]\nname = "model-{i:04d}"\nmodel = "{SOURCES[i % len(SOURCES)]}"\nprecision = "bf16"\n'
                    f"{where}context = 8192\nreplicas = 1\n\n")


def write_keys(path: Path, keys: int) -> None:
    with path.open("w") as f:
        for i in range(keys):
            f.write(f'[[key]]\nname = "key-{i:05d}"\ntenant = "team-{i % 50}"\nrequests_per_minute = 600\n'
                    "tokens_per_day = 1000000\n\n")


class Sampler(threading.Thread):
    """nats-server's resident memory every 0.2 s: the peak and the last."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_mib, self.last_mib = pid, 0.0, 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            kib = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmRSS:"))
            self.last_mib = kib / 1024
            self.peak_mib = max(self.peak_mib, self.last_mib)


def child_pid(parent: int, name: str) -> int:
    for _ in range(100):
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(parent) and fields.get("Name", "").strip() == name:
                return int(status.parent.name)
        time.sleep(0.1)
    raise SystemExit(f"no {name} under pid {parent}")


def status(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([*LLMGW, "ctl", "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return {}
    return dict(json.loads(out.stdout))


def timed_status(env: dict[str, str], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([*LLMGW, "ctl", "status", "--json"], env=env, capture_output=True, check=True, timeout=60)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wait(what: str, cond: object, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if cond():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(f"{what}: not within {limit_s:.0f}s")


def takes(port: int, secret: str) -> bool:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return bool(r.status == 200)
    except urllib.error.HTTPError as e:
        return e.code != 401  # 429: known, and polled past its requests a minute
    except (urllib.error.URLError, OSError):
        return False


async def control_consumers(url: str, password: str) -> dict[bool, int]:
    """The control stream's consumers, counted by whether they have a subject filter."""
    import nats

    nc = await nats.connect(url, user="admin", password=password, inbox_prefix="_INBOX.admin")
    try:
        counts: dict[bool, int] = {}
        offset = 0
        while True:
            reply = await nc.request("$JS.API.CONSUMER.LIST.LLMGW_CONTROL", json.dumps({"offset": offset}).encode(),
                                     timeout=10)
            page = json.loads(reply.data)
            for c in page.get("consumers") or []:
                cfg = c["config"]
                key = bool(cfg.get("filter_subject") or cfg.get("filter_subjects"))
                counts[key] = counts.get(key, 0) + 1
            offset += len(page.get("consumers") or [])
            if not page.get("consumers") or offset >= page.get("total", 0):
                return counts
    finally:
        await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--placed", type=int, default=40)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--routers", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-scale-"))
    fleet, models, keys = tmp / "fleet.toml", tmp / "models.toml", tmp / "keys.toml"
    write_fleet(fleet, args.nodes)
    write_models(models, args.models, args.placed)
    write_keys(keys, args.keys)
    ports = [free_port() for _ in range(args.routers)]
    env = dict(os.environ, LLMGW_MODELS_DIR=str(ROOT / "examples" / "models"), LLMGW_DATA_DIR=str(tmp / "data"))
    up = subprocess.Popen([*LLMGW, "up", "--simulate", str(fleet), "--data-dir", str(tmp / "data"), "--port", "0",
                           "--router-listen", f"127.0.0.1:{ports[0]}", "--dashboard-listen", "off", "--no-example",
                           "--heartbeat-s", "5", "--engine-startup-s", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    routers: list[subprocess.Popen[bytes]] = []
    try:
        assert up.stdout is not None
        match = re.match(r"nats: (nats://\S+)", up.stdout.readline())
        if not match:
            raise SystemExit("llmgw up did not start")
        env["LLMGW_NATS_URL"] = match.group(1)
        threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()  # type: ignore[union-attr]
        sampler = Sampler(child_pid(up.pid, "nats-server"))
        sampler.start()
        logins = json.loads((tmp / "data" / "nats" / "credentials.json").read_text())["users"]
        for i, port in enumerate(ports[1:], start=2):
            routers.append(subprocess.Popen(
                [*LLMGW, "router", "--listen", f"127.0.0.1:{port}", "--name", f"router-{i}", "--nats-user", "router",
                 "--nats-password", logins["router"]], env=env, stdout=subprocess.DEVNULL,
                stderr=(tmp / f"router-{i}.log").open("w"), start_new_session=True))
        up_s = wait("every node's inventory", lambda: status(env).get("nodes") == args.nodes, 300)
        print(f"{args.nodes} nodes up and reporting: {up_s:.1f} s after nats-server; nats-server RSS "
              f"{sampler.last_mib:.0f} MiB")
        idle_status = timed_status(env)
        print(f"ctl status --json, idle fleet: {idle_status:.2f} s (median of 5)")

        t0 = time.perf_counter()
        done = subprocess.run([*LLMGW, "apply", str(models)], env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"apply failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        apply_s = time.perf_counter() - t0
        print(f"apply of {args.models} models: {apply_s:.1f} s")

        def healthy() -> bool:
            by_state = status(env).get("replicas_by_state") or {}
            return int(by_state.get("healthy", 0)) >= args.placed + min(SCARCE, args.models - args.placed)  # type: ignore[union-attr]

        settled = wait("the placed replicas healthy", healthy, 600)
        report = status(env)
        print(f"  then {report.get('replicas_by_state')} replicas, {len(report.get('unplaceable') or [])} models "  # type: ignore[arg-type]
              f"unplaceable: {settled:.1f} s more")

        t0 = time.perf_counter()
        out = subprocess.run([*LLMGW, "ctl", "key", "import", str(keys)], env=env, capture_output=True, text=True,
                             timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"key import failed: {out.stderr[-2000:]}")
        import_s = time.perf_counter() - t0
        last = out.stdout.strip().splitlines()[-1].split("\t")[1]
        pending = set(ports)
        while pending and time.perf_counter() - t0 < 300:
            pending = {p for p in pending if not takes(p, last)}
            time.sleep(0.05)
        visible_s = time.perf_counter() - t0
        print(f"ctl key import of {args.keys} keys: {import_s:.1f} s; the last taken by all {args.routers} routers "
              f"{visible_s:.1f} s after the import began" + (f" (never by {sorted(pending)})" if pending else ""))
        full_status = timed_status(env)
        print(f"ctl status --json, all stored: {full_status:.2f} s (median of 5)")
        sampler.done.set()
        print(f"nats-server RSS: peak {sampler.peak_mib:.0f} MiB, now {sampler.last_mib:.0f} MiB")
        filtered = asyncio.run(control_consumers(env["LLMGW_NATS_URL"], logins["admin"]))
        print(f"LLMGW_CONTROL consumers: {sum(filtered.values())} ({filtered.get(True, 0)} with a subject filter)")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("| nodes | models (placed) | keys | nats-server RSS peak | ctl status idle / full | apply | keys on every router |")
        print(f"| {args.nodes} | {args.models} ({args.placed}) | {args.keys} | {sampler.peak_mib:.0f} MiB | "
              f"{idle_status:.2f} / {full_status:.2f} s | {apply_s:.1f} s | {visible_s:.1f} s |")
    finally:
        for proc in routers:
            proc.terminate()
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        for proc in routers:
            proc.wait(10)


if __name__ == "__main__":
    main()
