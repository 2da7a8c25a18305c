"""``llmgw nats-conf``: write nats.conf (roles, per-node agent users) and test credentials;
``llmgw declare-streams``: declare llmgw's streams as admin, the one role that may."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import click

from llmgw import fleetfile
from llmgw.bus import natsconf
from llmgw.cli.options import nats_options, run
from llmgw.config import Settings


def _prepare(path: Path, text: str, mode: int | None = None) -> Path:
    """Write ``text`` to a temporary file next to ``path``; the caller renames it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def write_files(files: list[tuple[Path, str, int | None]]) -> None:
    """Write each file whole or not at all: temporary files first, renamed into place once all are written."""
    done: list[tuple[Path, Path]] = []
    path = Path()
    try:
        for path, text, mode in files:
            done.append((_prepare(path, text, mode), path))
        for tmp, path in done:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in done:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise click.ClickException(f"cannot write {path}: {e.strerror or e}; check that its directory exists "
                                   "and is writable") from e


@click.command("nats-conf")
@click.option("--fleet", "fleet_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Fleet file whose nodes get agent users.")
@click.option("--node", "nodes", multiple=True, help="An agent node (repeatable; adds to --fleet).")
@click.option("--router", "routers", multiple=True, help="A router that gets its own user, publishing only its own usage subjects (repeatable; the shared `router` user remains).")
@click.option("--store-dir", default="/data/jetstream", show_default=True, help="JetStream store directory on the server.")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the config here instead of stdout.")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), help="Also write random passwords for every user (LLMGW_PW_*=…) here.")
def nats_conf(fleet_path: Path | None, nodes: tuple[str, ...], routers: tuple[str, ...], store_dir: str, out: Path | None,
              env_file: Path | None) -> None:
    """Generate nats.conf with one user per role and one per agent node.

    Example:

        llmgw nats-conf --fleet examples/fleet.toml -o nats.conf --env-file creds.env
        set -a; . ./creds.env; nats-server -c nats.conf
    """
    names = [n.name for n in fleetfile.load(fleet_path).nodes] if fleet_path else []
    names += [n for n in nodes if n not in names]
    if not names:
        raise click.UsageError("name the agent nodes: --fleet FILE or --node NAME (repeatable)")
    text = natsconf.render(names, routers=routers, store_dir=store_dir)
    passwords = natsconf.env_file(natsconf.make_passwords(names, routers)) if env_file is not None else ""
    files: list[tuple[Path, str, int | None]] = [(out, text, None)] if out is not None else []
    if env_file is not None:
        files.append((env_file, passwords, 0o600))
    write_files(files)
    if out is None:
        click.echo(text, nl=False)
    else:
        click.echo(f"wrote {out}: {len(natsconf.users(names, routers))} users ({len(names)} agent nodes)", err=True)
    if env_file is not None:
        click.echo(f"wrote {env_file}: passwords for every user; load with `set -a; . {env_file}`", err=True)


@click.command("declare-streams")
@click.option("--lease-ttl", "lease_ttl_s", type=click.FloatRange(0.5, 3600), default=10.0, show_default=True,
              help="Seconds a dead scheduler's lease outlives it (the lease bucket's TTL, set when it is created).")
@nats_options
def declare_streams(settings: Settings, lease_ttl_s: float) -> None:
    """Declare llmgw's streams (create, or update to this version's limits); log in as admin.

    Under the shipped nats.conf only ``admin`` may create or update streams and buckets
    (the fold snapshots' object store, the scheduler's lease); every other role finds them declared. Run it once before the control plane starts,
    and again after an upgrade.

    Example:

        LLMGW_NATS_USER=admin LLMGW_NATS_PASSWORD=$LLMGW_PW_ADMIN llmgw declare-streams --nats-url nats://nats:4222
    """
    from llmgw.bus import Bus

    async def main() -> None:
        # Admin's job: under `llmgw up`, the data directory's admin login (when no other is given).
        bus = await Bus.connect(settings.with_local_login("admin"), "llmgw-declare-streams", reconnect=False)
        try:
            await bus.ensure_streams(lease_ttl_s=lease_ttl_s)
        finally:
            await bus.close()

    run(main())
    click.echo(f"declared {', '.join((*natsconf.ALL_STREAMS, natsconf.SNAPSHOT_STREAM, natsconf.LEASE_STREAM))} "
               f"on {settings.nats_url}", err=True)
