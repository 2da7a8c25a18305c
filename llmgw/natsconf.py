"""nats.conf for production: one llmgw account, one user per role, one per agent node.

A static nats-server config cannot template permissions on a user's name
(``{{name()}}`` works in JWT/operator mode only), so each agent node gets its
own user whose publish rights end in that node's subject token. ``render`` is
the one source of the permission blocks: the shipped ``nats.conf`` is its
output for ``examples/fleet.toml``, and the tests start nats-server with it.
Passwords are environment references (``$LLMGW_PW_…``), never literals.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Sequence

from llmgw import subjects as s

ACCOUNT = "LLMGW"
SYSTEM_ACCOUNT = "SYS"
ROLES = ("admin", "projector", "planner", "scheduler", "router", "cli")
MIN_SERVER_VERSION = (2, 12, 3)

P = s.PREFIX
INBOX = "_INBOX.>"
JS_INFO = s.JS_API_INFO

# JetStream API subjects as llmgw's bus uses them (Bus.ensure_streams, StreamReader, key_value).


def _stream_info(stream: str) -> str:
    return s.js_stream("INFO", stream)


def _read(stream: str) -> list[str]:
    """What a StreamReader needs: an ephemeral consumer, pull requests, and deleting it."""
    return [
        _stream_info(stream),
        s.js_consumer("CREATE", stream),
        s.js_consumer("CREATE", stream, ">"),
        s.js_consumer("MSG.NEXT", stream, "*"),
        s.js_consumer("DELETE", stream, "*"),
        s.js_consumer("INFO", stream, "*"),
    ]


def _declare(stream: str) -> list[str]:
    """Create or update (never delete or purge) a stream: Bus.ensure_streams."""
    return [s.js_stream("CREATE", stream), s.js_stream("UPDATE", stream)]


def _kv(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [
        _stream_info(stream),
        s.js_stream("CREATE", stream),
        s.js_api("DIRECT.GET", stream, ">"),
        s.js_stream("MSG.GET", stream),
        s.kv_subjects(bucket),
        *_read(stream)[1:],
    ]


ALL_STREAMS = tuple(spec.name for spec in s.STREAMS)
# Whatever a role's allow list says, these stay refused for every role but admin.
NEVER = [
    s.js_stream("DELETE", ">"),
    s.js_stream("PURGE", ">"),
    s.js_stream("MSG.DELETE", ">"),
    s.js_api("ACCOUNT.PURGE", ">"),
]


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def permissions(role: str, node: str | None = None) -> dict[str, object]:
    """The publish/subscribe rules of one role (``agent`` needs its node; a named ``router`` its name)."""
    pub: list[str] = [JS_INFO]
    sub: list[str] = [INBOX]
    responses = False
    deny_pub = list(NEVER)
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "agent":
        if not node:
            raise ValueError("an agent user needs its node name")
        tok = s.token(node)
        pub += [
            f"{P}.fleet.{tok}.>",
            f"{P}.heartbeat.{tok}",
            f"{P}.control.replica.*.state.{tok}",
            *_read(s.STREAM_CONTROL),
            *_read(s.STREAM_FLEET),  # its node's last GPU health, so a restart forgets no XID
        ]
        pub += [_stream_info(x) for x in ALL_STREAMS]
        sub += [s.agent_fault(node)]  # fault injection (simulated), or an operator's `clear`
        responses = True
        deny_pub += [f"{P}.usage.>", f"{P}.control.model.>"]
    elif role == "router":
        # A named router speaks only for itself; the shared "router" user for any router name.
        tok = s.token(node) if node else "*"
        pub += [f"{P}.usage.{tok}.idle", f"{P}.usage.{tok}.wanted", *_read(s.STREAM_CONTROL), *_read(s.STREAM_USAGE)]
        pub += [_stream_info(x) for x in ALL_STREAMS]
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>"]
    elif role == "projector":
        for stream in ALL_STREAMS:
            pub += [*_read(stream), *_declare(stream)]
        sub += [s.STATUS]
        responses = True
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>", f"{P}.usage.>"]
    elif role == "planner":
        for stream in (s.STREAM_FLEET, s.STREAM_CONTROL):
            pub += _read(stream)
        pub += [_stream_info(x) for x in ALL_STREAMS]
        sub += [s.PLAN]
        responses = True
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>", f"{P}.usage.>"]
    elif role == "scheduler":
        pub += [
            f"{P}.fleet.*.lost",
            f"{P}.fleet.*.returned",
            f"{P}.control.model.*.unplaceable",
            f"{P}.control.model.*.autoscaled",
            f"{P}.control.replica.*.placed",
            f"{P}.control.replica.*.stopped",
            *_kv(s.SCHEDULER_LEASE_BUCKET),
        ]
        for stream in ALL_STREAMS:
            pub += [*_read(stream), *_declare(stream)]
        deny_pub += [f"{P}.fleet.*.inventory", f"{P}.fleet.*.health", f"{P}.usage.>"]
    elif role == "cli":
        pub += [
            f"{P}.control.model.*.declared",
            f"{P}.control.model.*.scaled",
            f"{P}.control.model.*.removed",
            s.PLAN,
            s.STATUS,
            f"{P}.agent.*.fault",  # `llmgw agent fault`: only simulated agents answer it
        ]
        for stream in ALL_STREAMS:
            pub += _read(stream)
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.usage.>", f"{P}.control.replica.>"]
    else:
        raise ValueError(f"unknown role {role!r}; one of {', '.join((*ROLES, 'agent'))}")
    out: dict[str, object] = {
        "publish": {"allow": _unique(pub), "deny": _unique(deny_pub)},
        "subscribe": {"allow": _unique(sub)},
    }
    if responses:
        # Services answer on the asker's inbox without a blanket publish right to _INBOX.>.
        out["allow_responses"] = {"max": 1, "expires": "1m"}
    return out


def user_name(role: str, node: str | None = None) -> str:
    return f"{role}-{s.token(node)}" if role in ("agent", "router") and node else role


def password_env(user: str) -> str:
    """The environment variable nats.conf reads a user's password from."""
    return "LLMGW_PW_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()


def users(nodes: Sequence[str], routers: Sequence[str] = ()) -> list[tuple[str, str, str | None]]:
    """(user, role, node or router name) for every login nats.conf defines."""
    out: list[tuple[str, str, str | None]] = [(user_name(r), r, None) for r in ROLES]
    out += [(user_name("agent", n), "agent", n) for n in nodes]
    out += [(user_name("router", r), "router", r) for r in routers]
    return out


def make_passwords(nodes: Sequence[str], routers: Sequence[str] = ()) -> dict[str, str]:
    """Random passwords for every login, keyed by environment variable (and the system user's)."""
    env = {password_env(u): new_password() for u, _, _ in users(nodes, routers)}
    env[password_env("sys")] = new_password()
    return env


def new_password() -> str:
    """A random password nats-server reads back as a string.

    nats-server parses a ``$VAR``'s value as a config value: "9zq…" fails as a
    bad number, "-x…" as a negative one. A letter first, then hex, is always a string.
    """
    return "pw" + secrets.token_hex(20)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list(items: Sequence[str], indent: str) -> str:
    inner = ",\n".join(f"{indent}  {_q(x)}" for x in items)
    return f"[\n{inner}\n{indent}]"


def _perm_block(perms: dict[str, object], indent: str) -> str:
    lines = [f"{indent}permissions: {{"]
    for direction in ("publish", "subscribe"):
        rules = perms[direction]
        assert isinstance(rules, dict)
        lines.append(f"{indent}  {direction}: {{")
        for kind in ("allow", "deny"):
            if kind in rules:
                lines.append(f"{indent}    {kind}: {_list(rules[kind], indent + '    ')}")
        lines.append(f"{indent}  }}")
    if "allow_responses" in perms:
        r = perms["allow_responses"]
        assert isinstance(r, dict)
        lines.append(f"{indent}  allow_responses: {{ max: {r['max']}, expires: {_q(str(r['expires']))} }}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


HEADER = """\
# nats.conf for llmgw: generated by `llmgw nats-conf` (llmgw/natsconf.py); regenerate, don't hand-edit.
#
# Requires nats-server >= 2.12.3. Jepsen's 2025 analysis of NATS 2.12.1 found
# acknowledged writes lost when the server fsyncs lazily (the default syncs every
# 2 minutes), so this file sets `sync_interval: always`: every acknowledged
# publish is on disk before the ack. llmgw's fleet and control streams are its
# source of truth; run them at 3 replicas (LLMGW_STREAM_REPLICAS=3) on a cluster.
#
# Passwords are read from the environment (nats-server expands $VARS and parses
# their values: start each with a letter, e.g. pw<hex>); make test credentials
# with `llmgw nats-conf --env-file creds.env` and `set -a; . creds.env`.
# Each agent node has its own user: it may publish only its own node's subjects.
"""

def tls_block(ca_file: str, cert_file: str, key_file: str, *, verify: bool = True) -> str:
    """The server's tls {} block; the shipped nats.conf carries it commented out."""
    return (
        "tls {\n"
        f"  ca_file: {_q(ca_file)}\n"
        f"  cert_file: {_q(cert_file)}\n"
        f"  key_file: {_q(key_file)}\n"
        f"  verify: {'true' if verify else 'false'}  # require a client certificate signed by ca_file\n"
        "  timeout: 2\n"
        "}\n"
    )


TLS_BLOCK = """\
# TLS between every component and NATS: uncomment, point at your CA and the
# server's certificate, and give clients --tls-ca (and --tls-cert/--tls-key when
# verify is on; LLMGW_NATS_TLS_CA/_CERT/_KEY). Clients then use tls://host:4222.
""" + "".join(f"# {line}\n" for line in tls_block("/etc/nats/ca.pem", "/etc/nats/server.pem", "/etc/nats/server-key.pem").splitlines())

CLUSTER_BLOCK = """\
# A 3-node cluster (R3 streams survive one lost node): uncomment on each server
# with its own server_name and the other two in routes.
# server_name: "nats-1"
# cluster {
#   name: "llmgw"
#   listen: "0.0.0.0:6222"
#   routes: ["nats-route://nats-2:6222", "nats-route://nats-3:6222"]
# }
"""


def render(nodes: Sequence[str], *, routers: Sequence[str] = (), store_dir: str = "/data/jetstream", port: int = 4222) -> str:
    """The whole nats.conf for a fleet with these agent nodes (and named routers)."""
    out = [HEADER, f"port: {port}", "http: 8222  # monitoring: /healthz, /jsz", ""]
    out += [
        "jetstream {",
        f"  store_dir: {_q(store_dir)}",
        "  max_memory_store: 1GB",
        "  max_file_store: 200GB",
        "  sync_interval: always  # fsync before every ack (see above)",
        "}",
        "",
        "max_payload: 8MB  # the largest inventory of a 16-GPU node is ~10 KB; 8 MB is a guard, not a need",
        "",
        TLS_BLOCK,
        CLUSTER_BLOCK,
        f"system_account: {SYSTEM_ACCOUNT}",
        "",
        "accounts {",
        f"  {SYSTEM_ACCOUNT} {{",
        f"    users: [ {{ user: \"sys\", password: ${password_env('sys')} }} ]",
        "  }",
        f"  {ACCOUNT} {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user, role, node in users(nodes, routers):
        who = (f"agent on node {node}" if role == "agent" else f"router {node}") if node else role
        out.append(f"      # {who}")
        out.append("      {")
        out.append(f"        user: {_q(user)}")
        out.append(f"        password: ${password_env(user)}")
        out.append(_perm_block(permissions(role, node), "        "))
        out.append("      }")
    out += ["    ]", "  }", "}", ""]
    return "\n".join(out)


def env_file(passwords: dict[str, str]) -> str:
    """``NAME=value`` lines for ``set -a; . file`` or compose's env_file."""
    return "".join(f"{k}={v}\n" for k, v in sorted(passwords.items()))
