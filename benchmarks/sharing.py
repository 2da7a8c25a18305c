"""Booked against used on real engines: what a llama.cpp replica books by its plan, and what the
real llama-server then holds, on the CPU (the stand-in a box without a GPU has for GPU memory).

    python benchmarks/sharing.py [--sizes 100,250,500,1000] [--context 4096] [--ready-s 180]

For each size (MB of Q8_0 weights, ``llmgw demo-model`` with heads 128 wide and 2 KV heads, so
that the weights dominate), and for a tiny model first: the plan on examples/cpu.toml
(``llmgw ctl model plan DIR --fleet examples/cpu.toml --json``, its q8_0 candidate), what its
replica books there (``llmgw.fleet.state.booking_mib`` of the candidate's spec), the command the
agent runs for that spec (``engine_argv``, with the real llama-server: env LLMGW_LLAMA_SERVER, or
what ``scripts/llama-server.sh`` prints last), and the llama-server's resident memory (VmRSS,
anonymous and file-backed, over its process tree) once healthy, after a short chat completion,
and after a prompt longer than one ubatch (512 tokens: the pages of llama.cpp's compute buffer
are resident only once a batch that large has run), beside the buffers llama.cpp's own log says
it allocated (model, KV, compute; ``-lv 4`` is added to the agent's command for that alone).

The tiny model measures the build's fixed runtime overhead: its resident memory less the weights
and KV cache llama.cpp allocated for it. The error is the resident memory after the long prompt
against the booking, raw, and adjusted: against the booking less the CUDA context the plan
charges (a CPU engine has none) plus that fixed overhead.

Each engine start is bounded (``--ready-s``); every llama-server started here is stopped, and
the models are written in a temporary directory that is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from llmgw import messages as m
from llmgw.engine.argv import engine_argv
from llmgw.fleet.state import booking_mib
from llmgw.fleetfile import parse
from llmgw.planner.memory import CUDA_CONTEXT_BYTES, MIB
from llmgw.proc import descendants

ROOT = Path(__file__).resolve().parent.parent
LLMGW = str(Path(sys.executable).parent / "llmgw")
FLEET = ROOT / "examples" / "cpu.toml"
HEAD = 128  # head width of the demo models: heads = embd / 128
KV_HEADS = 2
CUDA_MIB = CUDA_CONTEXT_BYTES / MIB
UBATCH = 512  # llama.cpp's default n_ubatch, what its compute buffer is sized for
BUFFER = re.compile(r"\b(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB")


@dataclass
class Row:
    name: str
    file_mib: float
    layers: int
    embd: int
    weights_mib: float = 0.0
    kv_mib: float = 0.0
    overhead_mib: float = 0.0
    booked_mib: int = 0
    healthy: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # after a short request
    prompt: dict[str, float] = field(default_factory=dict)  # after a prompt of one full ubatch
    prompt_tokens: int = 0
    buffers: dict[str, float] = field(default_factory=dict)
    start_s: float = 0.0


def shape(size_mb: float) -> tuple[int, int]:
    """(layers, embd) of a demo model with about ``size_mb`` MB of Q8_0 weights.

    A layer of width e with heads of 128 and 2 KV heads holds e² x (2 + 2 x 256/e) for attention
    and 12 e² for its MLP, at 8.5 bits a weight; the widest that gives at least four layers.
    """
    for embd in (2048, 1536, 1024, 768, 512, 256):
        per_layer = (2 * embd * embd + 2 * embd * KV_HEADS * HEAD + 12 * embd * embd) * 8.5 / 8
        layers = round(size_mb * 1e6 / per_layer)
        if layers >= 4 or embd == 256:
            return max(1, min(32, layers)), embd
    raise AssertionError("unreachable")


def llama_server() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    if given and os.access(given, os.X_OK):
        return given
    print("building or finding llama-server (bash scripts/llama-server.sh; ~20 CPU-minutes the first time)...",
          file=sys.stderr)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh")], capture_output=True, text=True,
                         timeout=3600, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines or not os.access(lines[-1], os.X_OK):
        sys.exit(f"Error: scripts/llama-server.sh gave no llama-server ({out.returncode}):\n{out.stderr[-2000:]}")
    return lines[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, object] | None = None, timeout: float = 60.0) -> tuple[int, object]:
    """GET (or POST ``body`` as JSON): the status and the decoded reply (0 and None when nothing answered)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return int(resp.status), json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as e:
        return int(e.code), None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def long_prompt(base: str, tokens: int) -> str:
    """A prompt of at least ``tokens`` tokens (one full ubatch fills llama.cpp's compute buffer)."""
    text, n = "hello", 0
    while n < tokens:
        text += " the quick brown fox jumps over the lazy dog" * 16
        status, reply = http(f"{base}/tokenize", {"content": text})
        if status != 200 or not isinstance(reply, dict):
            sys.exit(f"Error: /tokenize answered {status}")
        n = len(reply.get("tokens", ()))
    return text


def resident(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM in MiB, summed over ``pid`` and its descendants."""
    out = {"rss": 0.0, "anon": 0.0, "file": 0.0, "hwm": 0.0}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "VmHWM:": "hwm"}
    for p in {pid, *descendants([pid])}:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                k, _, rest = line.partition("\t")
                if k in keys:
                    out[keys[k]] += int(rest.split()[0]) / 1024
    return out


def plan(row: Row, model_dir: Path, context: int) -> m.ModelSpec:
    """The q8_0 llama.cpp candidate's figures and spec, as ``ctl model plan --json`` gives them."""
    out = subprocess.run([LLMGW, "ctl", "model", "plan", str(model_dir), "--fleet", str(FLEET), "--precision", "q8_0",
                          "--context", str(context), "--json"], capture_output=True, text=True, timeout=120, check=False)
    if out.returncode:
        sys.exit(f"Error: ctl model plan {model_dir} failed: {out.stderr or out.stdout}")
    reply = msgspec.json.decode(out.stdout, type=m.PlanReply)
    cand = next((c for c in reply.candidates if c.engine == "llama.cpp" and c.fits), None)
    if cand is None:
        sys.exit(f"Error: no llama.cpp candidate fits for {model_dir}: {out.stdout[:2000]}")
    spec = cand.spec(row.name)
    row.weights_mib = cand.weights_gib_per_gpu * 1024
    row.kv_mib = cand.kv_gib_per_gpu * 1024
    row.overhead_mib = cand.overhead_gib_per_gpu * 1024
    row.booked_mib = booking_mib(spec, card_mib())
    return spec


def card_mib() -> int:
    return parse(FLEET.read_text(), str(FLEET)).nodes[0].gpu_memory_mib


@contextlib.contextmanager
def engine(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def measure(row: Row, spec: m.ModelSpec, binary: str, work: Path, ready_s: float) -> None:
    port = free_port()
    # The agent's command for the spec; -lv 4 only makes llama.cpp log the buffers it allocates.
    spec = msgspec.structs.replace(spec, engine_args=(*spec.engine_args, "-lv", "4"))
    argv = engine_argv(spec, port, "127.0.0.1", {"llama.cpp": [binary]}, simulate=False, cpu=True)
    log = work / f"{row.name}.log"
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with engine(argv, log) as proc:
        while http(f"{base}/health", timeout=5)[0] != 200:
            if proc.poll() is not None:
                sys.exit(f"Error: llama-server for {row.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() - t0 > ready_s:
                sys.exit(f"Error: llama-server for {row.name} not healthy within {ready_s:g}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        row.start_s = time.monotonic() - t0
        time.sleep(1.0)  # let the start's last allocations settle
        row.healthy = resident(proc.pid)
        for key, prompt in (("served", "hello there, how are you?"), ("prompt", long_prompt(base, UBATCH + 8))):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
            status, reply = http(f"{base}/v1/chat/completions", body, timeout=ready_s)
            if status != 200 or not isinstance(reply, dict):
                sys.exit(f"Error: a chat completion to {row.name} answered {status}:\n{log.read_text()[-3000:]}")
            setattr(row, key, resident(proc.pid))
            row.prompt_tokens = int(reply.get("usage", {}).get("prompt_tokens", 0))
    for kind_, mib in ((k, float(v)) for _, k, v in BUFFER.findall(log.read_text(errors="replace"))):
        row.buffers[kind_] = row.buffers.get(kind_, 0.0) + mib


def pct(measured: float, planned: float) -> str:
    return f"{(measured - planned) / planned * 100:+6.1f} %" if planned else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,250,500,1000", help="MB of Q8_0 weights, comma-separated")
    ap.add_argument("--context", type=int, default=4096, help="context each replica is planned and started with")
    ap.add_argument("--ready-s", type=float, default=180.0, help="seconds an engine has to become healthy")
    args = ap.parse_args()
    try:
        sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: MB figures separated by commas, e.g. 100,250,500,1000")
    if not sizes or any(not 1 <= x <= 2000 for x in sizes):
        ap.error("--sizes: each from 1 to 2000 MB (the demo model's largest is ~1.7 GB)")
    if not 256 <= args.context <= 32768 or not 5 <= args.ready_s <= 1800:
        ap.error("--context is 256..32768 and --ready-s 5..1800")
    binary = llama_server()
    rows = [Row("tiny", 0.0, 1, 64)]
    for size in sizes:
        layers, embd = shape(size)
        rows.append(Row(f"demo-{size:g}mb", 0.0, layers, embd))
    with tempfile.TemporaryDirectory(prefix="llmgw-sharing-") as tmp:
        work = Path(tmp)
        for row in rows:
            d = work / row.name
            heads = ["--heads", "4", "--kv-heads", "2"] if row.embd < HEAD * 4 else \
                ["--heads", str(row.embd // HEAD), "--kv-heads", str(KV_HEADS)]
            subprocess.run([LLMGW, "demo-model", str(d), "--layers", str(row.layers), "--embd", str(row.embd),
                            "--context", str(args.context), *heads], capture_output=True, timeout=600, check=True)
            row.file_mib = sum(f.stat().st_size for f in d.glob("*.gguf")) / MIB
            spec = plan(row, d, args.context)
            measure(row, spec, binary, work, args.ready_s)
            print(f"{row.name}: healthy in {row.start_s:.1f}s, resident {row.prompt['rss']:.0f} MiB after "
                  f"{row.prompt_tokens} prompt tokens", file=sys.stderr)
    report(rows, args)


def report(rows: list[Row], args: argparse.Namespace) -> None:
    tiny = rows[0]
    # What the tiny engine holds beyond the weights and KV cache llama.cpp says it allocated.
    fixed = tiny.prompt["rss"] - tiny.buffers.get("model", 0.0) - tiny.buffers.get("KV", 0.0)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"\nllama-server on the CPU, the agent's command (-c {args.context} -np 1 -ngl 999), "
          f"q8_0 plans on {FLEET.relative_to(ROOT)}; load average {load}")
    print(f"fixed runtime overhead of this build: {fixed:.0f} MiB (the tiny model's resident "
          f"{tiny.prompt['rss']:.0f} MiB less its {tiny.buffers.get('model', 0.0) + tiny.buffers.get('KV', 0.0):.1f} "
          f"MiB of weights and KV); the plan charges a CUDA context of {CUDA_MIB:.0f} MiB in its place")
    print("error: resident after the long prompt against booked; adjusted: against booked less the CUDA context "
          "plus the fixed overhead (and, last, the same for the resident memory once healthy)\n")
    print("| model | layers × embd | GGUF MiB | plan: weights + KV + overhead MiB | booked MiB "
          "| llama.cpp allocated: model + KV + compute MiB | RSS healthy MiB | RSS after a short request "
          f"| RSS after a {tiny.prompt_tokens}-token prompt (anon + file) | error | adjusted | adjusted, healthy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        adjusted = r.booked_mib - CUDA_MIB + fixed
        logged = " + ".join(f"{r.buffers.get(k, 0.0):.0f}" for k in ("model", "KV", "compute"))
        print(f"| {r.name} | {r.layers} × {r.embd} | {r.file_mib:.0f} "
              f"| {r.weights_mib:.0f} + {r.kv_mib:.0f} + {r.overhead_mib:.0f} | {r.booked_mib} | {logged} "
              f"| {r.healthy['rss']:.0f} | {r.served['rss']:.0f} "
              f"| {r.prompt['rss']:.0f} ({r.prompt['anon']:.0f} + {r.prompt['file']:.0f}) "
              f"| {pct(r.prompt['rss'], r.booked_mib)} | {pct(r.prompt['rss'], adjusted) if r is not tiny else 'n/a'} "
              f"| {pct(r.healthy['rss'], adjusted) if r is not tiny else 'n/a'} |")
    sized = rows[1:]
    raw = all(abs(r.prompt["rss"] - r.booked_mib) <= 0.1 * r.booked_mib for r in sized)
    adj = all(abs(r.prompt["rss"] - (r.booked_mib - CUDA_MIB + fixed)) <= 0.1 * (r.booked_mib - CUDA_MIB + fixed)
              for r in sized)
    print(f"\ngoal: resident within ±10 % of the booked figure: raw {'met' if raw else 'NOT met'}, "
          f"adjusted {'met' if adj else 'NOT met'}")


if __name__ == "__main__":
    main()
