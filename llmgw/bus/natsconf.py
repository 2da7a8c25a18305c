"""nats.conf for production: one llmgw account, one user per role, one per agent node.

A static nats-server config cannot template permissions on a user's name
(``{{name()}}`` works in JWT/operator mode only), so each agent node gets its
own user whose publish rights end in that node's subject token. ``render`` is
the one source of the permission blocks: the shipped ``nats.conf`` is its
output for ``examples/fleet.toml``, and the tests start nats-server with it.
Passwords are environment references (``$LLMGW_PW_…``), never literals.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Sequence

from llmgw import subjects as s
from llmgw.errors import ConfigError

ACCOUNT = "LLMGW"
SYSTEM_ACCOUNT = "SYS"
ROLES = ("admin", "projector", "planner", "scheduler", "router", "cli", "viewer")
MIN_SERVER_VERSION = (2, 12, 3)

P = s.PREFIX
FLEET, CONTROL, USAGE, HEARTBEAT = s.STREAM_FLEET, s.STREAM_CONTROL, s.STREAM_USAGE, s.STREAM_HEARTBEAT
ENGINE_KEYS = s.STREAM_ENGINE_KEYS
ALL_STREAMS = tuple(spec.name for spec in s.STREAMS)
LEASE_STREAM = f"KV_{s.SCHEDULER_LEASE_BUCKET}"
SNAPSHOT_STREAM = f"OBJ_{s.SNAPSHOT_BUCKET}"

# The JetStream API subjects llmgw's bus calls, and nothing else: what a role is not
# granted here (stream create/update/delete/purge, listing consumers, snapshots, …)
# the server refuses. Only admin declares or changes streams (`llmgw declare-streams`).


def _info(*streams: str) -> list[str]:
    """``Bus.stream_head``/``ensure_streams``: a stream's last sequence and config."""
    return [s.js_stream("INFO", x) for x in streams]


def _read(*streams: str) -> list[str]:
    """What a StreamReader needs: a named ephemeral consumer (``CREATE.<stream>.<name>``, and
    ``….<name>.<filter>`` with one filter), pull requests, and deleting it.

    The subject cannot tell a named ephemeral consumer from a durable one (the body does), so a
    role may name consumers on the streams it reads; it reads nothing more through them.
    """
    out: list[str] = []
    for stream in streams:
        out += [
            *_info(stream),
            s.js_consumer("CREATE", stream, "*"),
            s.js_consumer("CREATE", stream, "*.>"),
            s.js_consumer("MSG.NEXT", stream, "*"),
            s.js_consumer("DELETE", stream, "*"),
        ]
    return out


def _lease() -> list[str]:
    """The scheduler's KV lease (nats-py's key_value/create/update/delete/get).

    The bucket is admin's to declare (``llmgw declare-streams --lease-ttl``), like every
    stream: a role that may create it before it exists may give it any subjects, and one
    with ``_INBOX.>`` would store every role's replies where its own reads can reach them.
    """
    return [
        *_info(LEASE_STREAM),
        s.js_api("DIRECT.GET", LEASE_STREAM, ">"),
        s.js_stream("MSG.GET", LEASE_STREAM),
        s.kv_subjects(s.SCHEDULER_LEASE_BUCKET),
    ]


def _snapshots_read() -> list[str]:
    """Reading fold snapshots: a stream read of the object store's stream (``ObjectBucket``), and direct
    gets of the control messages a snapshot's placements and endpoints came from, to check them."""
    return [*_read(SNAPSHOT_STREAM), s.js_api("DIRECT.GET", CONTROL), s.js_api("DIRECT.GET", CONTROL, ">")]


def _snapshots_write() -> list[str]:
    """The projector's: put (chunks, then the meta), and retention's delete (a deleted meta, then a purge
    of that object's chunks)."""
    return [*_snapshots_read(), f"$O.{s.SNAPSHOT_BUCKET}.C.>", f"$O.{s.SNAPSHOT_BUCKET}.M.>",
            s.js_stream("MSG.GET", SNAPSHOT_STREAM), s.js_stream("PURGE", SNAPSHOT_STREAM)]


# Whatever a role's allow list says, these stay refused for every role but admin.
NEVER = [
    s.js_stream("CREATE", ">"),
    s.js_stream("UPDATE", ">"),
    s.js_stream("DELETE", ">"),
    s.js_stream("PURGE", ">"),
    s.js_stream("MSG.DELETE", ">"),
    s.js_api("ACCOUNT.PURGE", ">"),
]


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def permissions(role: str, node: str | None = None, user: str | None = None) -> dict[str, object]:
    """The publish/subscribe rules of one role (``agent`` needs its node; a named ``router`` its name).

    ``user`` is the login the rules are for (default ``user_name(role, node)``):
    its inbox prefix is the only ``_INBOX`` it may subscribe to (``Bus.connect``
    asks nats-py for the same prefix), so no role reads another's replies.
    """
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    pub: list[str] = []
    sub: list[str] = [s.inbox_prefix(user or user_name(role, node)) + ".>"]
    responses = False
    deny_pub = list(NEVER)
    if role == "agent":
        if not node:
            raise ConfigError("an agent user needs its node name")
        # Its own node's facts only: lost/returned are the liveness monitor's (the scheduler's).
        pub += [s.fleet(node, "inventory"), s.fleet(node, "health"), s.heartbeat(node),
                s.fleet(node, "files"), s.fleet(node, "download"), s.fleet(node, "evicted"),  # what its disk holds
                f"{P}.control.replica.*.state.{s.token(node)}", f"{P}.control.replica.*.overbooked.{s.token(node)}",
                f"{P}.enginekey.*.{s.token(node)}"]  # its engines' API keys: written, never read back
        # Engines follow placements; the fleet stream holds the node's own last health.
        pub += _read(CONTROL, FLEET)
        sub += [s.agent_fault(node)]  # fault injection (simulated), or an operator's `clear`
        responses = True
        deny_pub += [f"{P}.fleet.*.lost", f"{P}.fleet.*.returned", f"{P}.usage.>", f"{P}.control.model.>"]
        deny_pub += [f"{P}.control.replica.*.placed", f"{P}.control.replica.*.stopped"]
    elif role == "router":
        # A named router speaks only for itself; the shared "router" user for any router name.
        tok = s.token(node) if node else "*"
        # Its own last idle map, read back at start so that idle time survives a restart.
        # The other routers' maps too: each key's quota counts what it asked through any router.
        # Its keys' use of the day (``.day``), which a router starting reads instead of a day of maps.
        pub += [f"{P}.usage.{tok}.idle", f"{P}.usage.{tok}.wanted", f"{P}.usage.{tok}.adapter", f"{P}.usage.{tok}.day",
                *_read(CONTROL, USAGE),
                s.js_api("DIRECT.GET", USAGE, f"{P}.usage.{tok}.idle")]
        pub += _read(ENGINE_KEYS)  # the engines' API keys: the one role that reads them, to reach the engines
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>"]
    elif role == "projector":
        pub += [*_read(*s.HISTORY_STREAMS, HEARTBEAT), *_info(*ALL_STREAMS), *_snapshots_write()]  # heartbeats: GPU use
        sub += [s.STATUS]
        responses = True
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>", f"{P}.usage.>"]
        # Retention purges old snapshots' chunks: purge is refused on every other stream by name.
        deny_pub = [x for x in deny_pub if x != s.js_stream("PURGE", ">")]
        deny_pub += [s.js_stream("PURGE", x) for x in (*ALL_STREAMS, LEASE_STREAM)]
    elif role == "planner":
        pub += _read(FLEET, CONTROL)
        sub += [s.PLAN]
        responses = True
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>", f"{P}.usage.>"]
    elif role == "scheduler":
        pub += [
            f"{P}.fleet.*.lost",  # the liveness monitor runs in the scheduler (or `llmgw agent liveness`)
            f"{P}.fleet.*.returned",
            f"{P}.control.model.*.unplaceable",
            f"{P}.control.model.*.autoscaled",
            f"{P}.control.node.*.cordoned",  # quarantine after fatal GPU faults
            f"{P}.control.replica.*.placed",
            f"{P}.control.replica.*.stopped",
            *_read(FLEET, CONTROL, USAGE, HEARTBEAT),
            *_info(*ALL_STREAMS),
            *_lease(),
        ]
        deny_pub += [f"{P}.fleet.*.inventory", f"{P}.fleet.*.health", f"{P}.usage.>", f"{P}.heartbeat.>"]
    elif role == "cli":
        pub += [
            f"{P}.control.model.*.declared",
            f"{P}.control.model.*.scaled",
            f"{P}.control.model.*.removed",
            f"{P}.control.model.*.prefetch",  # `ctl model prefetch`, `ctl model pin/unpin`
            f"{P}.control.model.*.pinned",
            f"{P}.control.adapter.*.declared",  # `ctl adapter add`
            f"{P}.control.node.*.cordoned",  # `ctl node cordon`, `drain`
            f"{P}.control.node.*.uncordoned",
            f"{P}.control.adapter.*.removed",
            f"{P}.control.replica.*.stopped",  # `ctl idle --stop`
            s.PLAN,
            s.STATUS,
            f"{P}.agent.*.fault",  # `llmgw agent fault`: simulated agents inject, every agent clears
            *_read(*s.HISTORY_STREAMS),
        ]
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.usage.>", f"{P}.control.replica.*.state.>",
                     f"{P}.control.replica.*.placed", f"{P}.control.key.>"]  # keys: admin's only
    elif role == "viewer":
        # Looks and asks, changes nothing: the dashboard, a read-only operator (no declarations, no stops).
        pub += [s.STATUS, s.PLAN, *_read(*s.HISTORY_STREAMS)]
        deny_pub += [f"{P}.fleet.>", f"{P}.heartbeat.>", f"{P}.control.>", f"{P}.usage.>", f"{P}.agent.>"]
    else:
        raise ConfigError(f"unknown role {role!r}; one of {', '.join((*ROLES, 'agent'))}")
    if role != "router":  # the engine keys' stream: routers read it, agents write their own node's, no one else
        deny_pub += [x for x in _read(ENGINE_KEYS) if x not in _info(ENGINE_KEYS)]
        deny_pub += [s.js_api("DIRECT.GET", ENGINE_KEYS, ">"), s.js_api("DIRECT.GET", ENGINE_KEYS),
                     s.js_stream("MSG.GET", ENGINE_KEYS)]
    if role != "agent":
        deny_pub += [f"{P}.enginekey.>"]
    if role != "projector":
        pub += _snapshots_read()  # every fold may start from a snapshot; only the projector writes them
        deny_pub += [f"$O.{s.SNAPSHOT_BUCKET}.>"]
    out: dict[str, object] = {
        "publish": {"allow": _unique(pub), "deny": _unique(deny_pub)},
        "subscribe": {"allow": _unique(sub)},
    }
    if responses:
        # Services answer on the asker's inbox without a blanket publish right to _INBOX.>.
        out["allow_responses"] = {"max": 1, "expires": "1m"}
    return out


def group_permissions(nodes: Sequence[str], user: str) -> dict[str, object]:
    """One login that speaks for several agent nodes, each only as far as its own user would: the
    simulated agents ``llmgw up`` runs in one process (a real node runs its own agent, as its own user)."""
    pub: list[str] = []
    deny: list[str] = []
    sub: list[str] = []
    for node in nodes:
        one = permissions("agent", node, user)
        pub += one["publish"]["allow"]  # type: ignore[index]
        deny += one["publish"]["deny"]  # type: ignore[index]
        sub += one["subscribe"]["allow"]  # type: ignore[index]
    return {"publish": {"allow": _unique(pub), "deny": _unique(deny)}, "subscribe": {"allow": _unique(sub)},
            "allow_responses": {"max": 1, "expires": "1m"}}


def user_name(role: str, node: str | None = None) -> str:
    return f"{role}-{s.token(node)}" if role in ("agent", "router") and node else role


# Node and router names that read the same upper-cased, with "-" as "_", need nothing more.
_PLAIN = re.compile(r"[a-z0-9-]+")


def password_env(user: str) -> str:
    """The environment variable nats.conf reads a user's password from.

    ``agent-h100-a-01`` reads ``LLMGW_PW_AGENT_H100_A_01``. Upper-casing and
    ``-`` → ``_`` are one-to-one only on ``[a-z0-9-]``; a user with any other
    character (``a_b``, ``A-B``, ``gpu.example.com``'s ``~2e``) also gets a hash
    of its exact name, so that ``a-b``, ``a_b`` and ``A-B`` read three variables.
    ``check_users`` refuses a conf where two users would still share one.
    """
    readable = "LLMGW_PW_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()
    if _PLAIN.fullmatch(user):
        return readable
    return f"{readable}_{hashlib.blake2b(user.encode(), digest_size=4).hexdigest().upper()}"


def check_names(nodes: Sequence[str], routers: Sequence[str] = ()) -> None:
    """Refuse node and router names a conf cannot carry, with the name and what to do."""
    for kind, names in (("node", nodes), ("router", routers)):
        for name in names:
            if not name or not name.strip():
                raise ConfigError(f"a {kind} name cannot be empty; give each {kind} its name "
                                  f"(e.g. --{kind} gpu-01)")
            if len(name) > MAX_NAME:
                raise ConfigError(f"{kind} name {name[:40]!r}… is {len(name)} characters; at most {MAX_NAME}")
            if any(not c.isprintable() for c in name):
                raise ConfigError(f"{kind} name {name!r} holds a control character; use letters, digits, '-', '.'")


MAX_NAME = 253  # a DNS name's limit: node names are host names


def users(nodes: Sequence[str], routers: Sequence[str] = ()) -> list[tuple[str, str, str | None]]:
    """(user, role, node or router name) for every login nats.conf defines.

    Raises ConfigError for a name no user can be made from, or two users that
    would read one password variable.
    """
    check_names(nodes, routers)
    out: list[tuple[str, str, str | None]] = [(user_name(r), r, None) for r in ROLES]
    out += [(user_name("agent", n), "agent", n) for n in dict.fromkeys(nodes)]
    out += [(user_name("router", r), "router", r) for r in dict.fromkeys(routers)]
    seen: dict[str, str] = {password_env("sys"): "sys"}
    for user, _, _ in out:
        env = password_env(user)
        if env in seen:
            raise ConfigError(f"users {seen[env]!r} and {user!r} would both read ${env}; rename one of them")
        seen[env] = user
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
# nats.conf for llmgw: generated by `llmgw nats-conf` (llmgw/bus/natsconf.py); regenerate, don't hand-edit.
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
# Only admin may create or update streams: declare them with `llmgw declare-streams`
# as admin before the other roles start. Each user may read replies only under its
# own inbox prefix, _INBOX.<user> (llmgw asks nats-py for it from LLMGW_NATS_USER).
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


def render(nodes: Sequence[str], *, routers: Sequence[str] = (), store_dir: str = "/data/jetstream", port: int = 4222,
           http_port: int | None = 8222, agent_group: tuple[str, Sequence[str]] | None = None) -> str:
    """The whole nats.conf for a fleet with these agent nodes (and named routers).

    ``http_port`` None: no monitoring port. ``agent_group`` (user, nodes): one more login that
    speaks for those nodes together (``group_permissions``), as ``llmgw up``'s simulated agents do.
    """
    out = [HEADER, f"port: {port}"]
    if http_port is not None:
        out.append(f"http: {http_port}  # monitoring: /healthz, /jsz")
    out.append("")
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
        out.append(_perm_block(permissions(role, node, user), "        "))
        out.append("      }")
    if agent_group is not None:
        group_user, group_nodes = agent_group
        out += [f"      # agents of nodes {', '.join(group_nodes)}, in one process", "      {",
                f"        user: {_q(group_user)}", f"        password: ${password_env(group_user)}",
                _perm_block(group_permissions(group_nodes, group_user), "        "), "      }"]
    out += ["    ]", "  }", "}", ""]
    return "\n".join(out)


def env_file(passwords: dict[str, str]) -> str:
    """``NAME=value`` lines for ``set -a; . file`` or compose's env_file."""
    return "".join(f"{k}={v}\n" for k, v in sorted(passwords.items()))
