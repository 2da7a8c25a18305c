"""How long a read command takes end to end, against the interpreter starting and doing nothing.

Starts ``llmgw up`` (embedded nats-server, projector, planner, scheduler, router; no
simulated fleet, so the machine stays quiet) in a temporary directory, waits until
``llmgw ctl status --json`` answers, then runs each command below ``--runs`` times,
interleaved so that load on the machine hits all of them alike, and prints the
median and 90th percentile wall time of each. Then where the imports of
``ctl status --json`` go (``python -X importtime``, by top-level package).

    python benchmarks/cli.py [--runs 30] [--before DIR]

``--before DIR`` also times ``ctl status --json`` of another tree in the same run (e.g.
``git archive <commit> | tar -x -C DIR``; it is put first on PYTHONPATH, with ``DIR/llmgw/cli``
and ``DIR/llmgw/projections`` linked to its cli/ and projections/ as the install maps them).

Goal (issues 19 and 46): ``llmgw ctl status --json`` ≤ 0.2 s median on the benchmark machine,
beside ``python -c pass`` and ``python -c "import nats"`` in the same run. The load average
is printed before and after (the machine is shared). Figures are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PY = sys.executable
LLMGW = [PY, "-m", "llmgw"]
GOAL_S = 0.2


def commands() -> dict[str, list[str]]:
    return {
        "python -c pass": [PY, "-c", "pass"],
        "python -c 'import nats'": [PY, "-c", "import nats"],
        "python -c 'import llmgw.bus.connection'": [PY, "-c", "import llmgw.bus.connection"],  # Bus: nats-py, no aiohttp
        "llmgw --help": [*LLMGW, "--help"],
        "llmgw ctl status --json": [*LLMGW, "ctl", "status", "--json"],
        "llmgw ctl status": [*LLMGW, "ctl", "status"],
        "llmgw ctl model list --json": [*LLMGW, "ctl", "model", "list", "--json"],
        "llmgw ctl idle --json": [*LLMGW, "ctl", "idle", "--json"],
        "llmgw ctl status --replay --json": [*LLMGW, "ctl", "status", "--replay", "--json"],  # Bus and a fold
    }


def start_up(root: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([*LLMGW, "up", "--port", "0", "--router-listen", "127.0.0.1:0", "--no-example",
                             "--data-dir", str(root), "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.match(r"nats: (nats://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"llmgw up did not start: {line.strip()}")
    return proc, match.group(1)


def wait_ready(env: dict[str, str], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if subprocess.run([*LLMGW, "ctl", "status", "--json"], env=env, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise SystemExit("ctl status did not answer within a minute")


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    # `python -m` puts the working directory first on the path: the tree asked for runs from its own.
    res = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=env.get("PYTHONPATH"))
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {res.stderr.decode()[-500:]}")
    return took


def imports_by_package(env: dict[str, str]) -> list[tuple[str, float]]:
    """Self time of every module imported by ``ctl status --json``, summed per top-level package (ms)."""
    res = subprocess.run([PY, "-X", "importtime", "-m", "llmgw", "ctl", "status", "--json"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    per: dict[str, float] = defaultdict(float)
    for line in res.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s+(\S.*)$", line)
        if m:
            name = m.group(2).strip()
            top = ".".join(name.split(".")[:2]) if name.startswith("llmgw.") else name.split(".")[0]
            per[top] += int(m.group(1)) / 1000
    return sorted(per.items(), key=lambda kv: -kv[1])


def loaded_by_status(env: dict[str, str]) -> set[str]:
    """Every module ``ctl status --json`` imported (from ``-X importtime``)."""
    res = subprocess.run([PY, "-X", "importtime", "-m", "llmgw", "ctl", "status", "--json"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return {m.group(1).strip() for line in res.stderr.splitlines()
            if (m := re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S.*)$", line))}


def before_env(env: dict[str, str], tree: Path) -> dict[str, str]:
    """``env`` with ``tree``'s llmgw first on the path, its cli/ and projections/ where the install puts them."""
    for name in ("cli", "projections"):
        link = tree / "llmgw" / name
        if not link.exists():
            link.symlink_to(tree / name)
    return dict(env, PYTHONPATH=str(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--before", type=Path, help="another tree whose `ctl status --json` is timed beside")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-cli-"))
    up, url = start_up(root)
    env = dict(os.environ, LLMGW_NATS_URL=url)
    try:
        wait_ready(env)
        cmds = commands()
        envs = {name: env for name in cmds}
        if args.before:
            cmds["before: llmgw ctl status --json"] = cmds["llmgw ctl status --json"]
            envs["before: llmgw ctl status --json"] = before_env(env, args.before.resolve())
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for name, argv in cmds.items():  # warm the page cache and the .pyc files
            timed(argv, envs[name])
        load_before = os.getloadavg()[0]
        for _ in range(args.runs):
            for name, argv in cmds.items():
                times[name].append(timed(argv, envs[name]))
        base = statistics.median(times["python -c pass"])
        print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, {args.runs} runs each, interleaved; "
              f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n")
        print(f"{'command':<40} {'median':>8} {'p90':>8} {'- python':>9}")
        for name, xs in times.items():
            xs.sort()
            med, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
            print(f"{name:<40} {med * 1000:>6.0f}ms {p90 * 1000:>6.0f}ms {(med - base) * 1000:>7.0f}ms")
        status = statistics.median(times["llmgw ctl status --json"])
        print(f"\nctl status --json median {status:.3f}s: {'within' if status <= GOAL_S else 'ABOVE'} the {GOAL_S}s goal")
        imported = loaded_by_status(env)
        print(f"`ctl status --json` imports nats-py: {'nats' in imported}, aiohttp: {'aiohttp' in imported}, "
              f"asyncio: {'asyncio' in imported}")
        print("\nimports of `ctl status --json` by package (self time, ms, under -X importtime, which inflates them):")
        for name, ms in imports_by_package(env)[:15]:
            print(f"  {name:<24} {ms:6.1f}")
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
