"""``llmgw nats-conf``: write nats.conf (roles, per-node agent users) and test credentials."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw import fleetfile, natsconf


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
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
        click.echo(f"wrote {out}: {len(natsconf.users(names, routers))} users ({len(names)} agent nodes)", err=True)
    if env_file is not None:
        env_file.write_text(natsconf.env_file(natsconf.make_passwords(names, routers)))
        env_file.chmod(0o600)
        click.echo(f"wrote {env_file}: passwords for every user; load with `set -a; . {env_file}`", err=True)
