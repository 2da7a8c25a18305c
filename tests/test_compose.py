"""compose.yaml, checked without a Docker engine: every command is one the CLI has, with options it parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from llmgw import natsconf
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


def test_agent_gets_the_gpus() -> None:
    agent = SERVICES["agent"]
    assert agent["runtime"] == "nvidia"
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


@pytest.mark.parametrize("service", LLMGW_SERVICES)
def test_service_logs_in_as_a_user_of_nats_conf(service: str) -> None:
    env = SERVICES[service]["environment"]
    user = env["LLMGW_NATS_USER"]
    conf = (ROOT / "nats.conf").read_text()
    assert f'user: "{user}"' in conf
    assert env["LLMGW_NATS_PASSWORD"] == "${" + natsconf.password_env(user) + "}"
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
