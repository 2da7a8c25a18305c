"""What a declaration may make an agent start (issue 45, finding 4): engine arguments from the allow-list
in every form an engine parses, model files only from the agent's stores; ``deploy`` refuses early, and
the agent, the trust boundary, refuses what a ``cli`` login publishes past ``deploy``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest
from llama import llama_server_binary
from test_e2e import (
    LLMGW,
    ROOT,
    control_events,
    healthy,
    llmgw,
    login,
    ok,
    start_up,
    stop_up,
    wait_for,
)

from llmgw import ctl
from llmgw import messages as m
from llmgw.cli.options import run
from llmgw.engine.policy import EnginePolicy, args_problem, spec_problem

REFUSED = [
    ("llama.cpp", ["--host", "0.0.0.0"], "--host"),
    ("llama.cpp", ["--host=0.0.0.0"], "--host"),
    ("llama.cpp", ["--port", "1"], "--port"),
    ("llama.cpp", ["-a", "other"], "-a"),
    ("llama.cpp", ["--alias", "other"], "--alias"),
    ("llama.cpp", ["-m", "/etc/shadow"], "-m"),
    ("llama.cpp", ["--path", "/srv"], "--path"),
    ("llama.cpp", ["--log-file", "/tmp/x"], "--log-file"),
    ("llama.cpp", ["--api-key", "k"], "--api-key"),
    ("llama.cpp", ["--slot-save-path=/tmp"], "--slot-save-path"),
    ("llama.cpp", ["-fa", "--path", "/srv"], "--path"),  # a flag never hides as another's value
    ("vllm", ["--trust-remote-code"], "--trust-remote-code"),
    ("vllm", ["--trust_remote_code"], "--trust_remote_code"),
    ("vllm", ["--trust-remote"], "--trust-remote"),  # argparse would take the abbreviation
    ("vllm", ["-qfp8"], "-qfp8"),  # and a glued short option
    ("vllm", ["--api-key=k"], "--api-key"),
    ("vllm", ["--served-model-name", "x"], "--served-model-name"),
    ("vllm", ["--chat-template", "/etc/passwd"], "--chat-template"),
    ("vllm", ["--speculative-config.model=/x"], "--speculative-config.model"),
]


@pytest.mark.parametrize(("engine", "args", "flag"), REFUSED)
def test_refused_arguments_are_named(engine: str, args: list[str], flag: str) -> None:
    why = args_problem(engine, args)
    assert why is not None and f"engine argument {flag} is refused" in why
    assert f"--allow-engine-arg={flag}" in why


@pytest.mark.parametrize(("engine", "args"), [
    ("llama.cpp", ["-t", "2", "-lv", "4"]),
    ("llama.cpp", ["-fa", "on", "--seed", "-1", "--temp=0.5", "--jinja"]),
    ("vllm", ["--enforce-eager", "--enable-prefix-caching", "--dtype=bfloat16"]),
    ("vllm", ["--max_model_len", "4096", "--kv-cache-memory-bytes", "1073741824", "-tp", "2"]),
])
def test_what_plans_and_tuning_use_is_accepted(engine: str, args: list[str]) -> None:
    assert args_problem(engine, args) is None


def test_a_stray_value_or_a_missing_one_is_refused() -> None:
    assert "not a flag" in (args_problem("vllm", ["/models/other"]) or "")
    assert "takes a value" in (args_problem("vllm", ["--dtype"]) or "")


def test_an_operator_allows_a_flag_per_agent() -> None:
    policy = EnginePolicy.of(["--log-file"])
    assert args_problem("llama.cpp", ["--log-file", "/var/log/e.log"], policy) is None
    assert args_problem("llama.cpp", ["--log-file=/var/log/e.log", "--host", "h"], policy) is not None
    assert args_problem("vllm", ["--trust_remote_code"], EnginePolicy.of(["--trust-remote-code"])) is None
    with pytest.raises(ValueError, match="expected an engine flag"):
        EnginePolicy.of(["log-file"])


def gguf_spec(source: str, file: str | None) -> m.ModelSpec:
    return m.ModelSpec(name="t", source=source, precision="q8_0", engine="llama.cpp", gpu_class="CPU-16GB",
                       context=512, file=file)


def test_model_files_resolve_inside_the_stores(tmp_path: Path) -> None:
    store, outside = tmp_path / "store", tmp_path / "outside"
    (store / "tiny").mkdir(parents=True)
    outside.mkdir()
    (store / "tiny" / "t.gguf").write_bytes(b"x")
    (outside / "secret").write_text("s")
    (store / "link").symlink_to(outside)
    policy = EnginePolicy.of([], roots=[store])
    assert spec_problem(gguf_spec(str(store / "tiny"), "t.gguf"), policy) is None
    for source, file in [("/etc", "shadow"), (str(store / "tiny"), "/etc/shadow"),
                         (str(store / "tiny"), "../../outside/secret"), (str(store / "link"), "secret")]:
        why = spec_problem(gguf_spec(source, file), policy)
        assert why is not None and "outside this agent's model stores" in why, (source, file)
    # A fake engine opens no file; its arguments are still held to the table.
    assert spec_problem(gguf_spec("/etc", "shadow"), policy, reads_files=False) is None
    evil = msgspec.structs.replace(gguf_spec("/etc", "shadow"), engine_args=("--path", "/"))
    assert "--path is refused" in (spec_problem(evil, policy, reads_files=False) or "")


def replica_state(url: str, rid: str) -> dict[str, object] | None:
    for e in reversed(control_events(url)):
        if e.get("replica_id") == rid and e["type"] == "ReplicaStateChanged":
            return e
    return None


def failed(url: str, rid: str) -> dict[str, object] | None:
    e = replica_state(url, rid)
    return e if e is not None and e["state"] == "failed" else None


def llama_argvs() -> list[list[str]]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if Path(argv[0]).name == "llama-server":
                out.append(argv)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_llama_server_never_sees_a_refused_flag_nor_a_file_outside_the_stores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = llama_server_binary()
    store, secret = tmp_path / "store", tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("do not serve")
    made = subprocess.run([LLMGW, "demo-model", str(store / "tiny"), "--context", "2048"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    (store / "link").symlink_to(secret)
    monkeypatch.setenv("LLMGW_ALLOW_MODEL_PATH", str(store))  # the agents' third store
    up, url = start_up(tmp_path, ROOT / "examples" / "cpu.toml", "--engines", "real", "--engine-cmd",
                       f"llama.cpp={binary} -t 1")
    try:
        wait_for("the node reported", lambda: json.loads(ok(url, "ctl", "status", "--replay", "--json"))["nodes"] == 1)
        deploy = ["ctl", "model", "deploy", "tiny", str(store / "tiny"), "--from-plan", "--precision", "q8_0",
                  "--context", "512"]
        # deploy refuses early, names the flag, publishes nothing.
        r = llmgw(url, *deploy, "--engine-arg=--path", f"--engine-arg={secret}")
        assert r.returncode == 1 and "Error: engine argument --path is refused" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not any(e["type"] == "ModelDeclared" for e in control_events(url))
        ok(url, *deploy)
        wait_for("tiny-r1 healthy", lambda: healthy(url, "tiny-r1"), within_s=90)
        spec = next(e["spec"] for e in control_events(url) if e["type"] == "ModelDeclared")

        # Past deploy, as a `cli` login may: the agent refuses, and says why where operators look.
        cli = login(url, "cli")
        base = msgspec.convert(spec, m.ModelSpec)
        log_file = tmp_path / "written.log"
        evil = msgspec.structs.replace(base, name="evil", engine_args=(
            "--path", str(secret), "--log-file", str(log_file), "--host=0.0.0.0"))
        linked = msgspec.structs.replace(base, name="linked", source=str(store / "link"), file="key.txt")
        shadow = msgspec.structs.replace(base, name="shadow", file="/etc/shadow")
        for s in (evil, linked, shadow):
            run(ctl.declare(cli, s))
        said = wait_for("evil-r1 refused", lambda: failed(url, "evil-r1"), within_s=60)
        assert "engine argument --path is refused" in str(said["detail"]) and "not started" in str(said["detail"])
        for rid in ("linked-r1", "shadow-r1"):
            said = wait_for(f"{rid} refused", lambda rid=rid: failed(url, rid), within_s=60)
            assert "outside this agent's model stores" in str(said["detail"])
        assert "--path is refused" in ok(url, "ctl", "model", "show", "evil")
        # Nothing refused reached a llama-server: only tiny's runs, with llmgw's own arguments.
        argvs = llama_argvs()
        assert argvs and all("--path" not in a and "--log-file" not in a and "/etc/shadow" not in a for a in argvs)
        assert all(str(store / "tiny") in " ".join(a) for a in argvs)
        assert not log_file.exists()
    finally:
        stop_up(up)
