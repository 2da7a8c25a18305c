"""``llmgw ctl``: the operator's commands (status, models, idle)."""

from __future__ import annotations

import click

from llmgw.cli.options import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        "status": "llmgw.cli.status:status",
        "idle": "llmgw.cli.idle:idle",
        "what-if": "llmgw.cli.whatif:what_if",
        "usage": "llmgw.cli.usage:usage",
        "request": "llmgw.cli.requests:request",
    },
)
def ctl() -> None:
    """Ask the control plane: plans, status, what can be stopped."""


@ctl.group(
    cls=LazyGroup,
    lazy={
        "plan": "llmgw.cli.plan:plan",
        "deploy": "llmgw.cli.models:deploy",
        "scale": "llmgw.cli.models:scale",
        "remove": "llmgw.cli.models:remove",
        "list": "llmgw.cli.models:list_models",
        "show": "llmgw.cli.models:show",
        "prefetch": "llmgw.cli.files:prefetch",
        "pin": "llmgw.cli.files:pin",
        "unpin": "llmgw.cli.files:unpin",
        "files": "llmgw.cli.files:files_cmd",
    },
)
def model() -> None:
    """Plan, deploy, scale, list, show and remove models; fetch, pin and find their files."""


@ctl.group(cls=LazyGroup, lazy={"add": "llmgw.cli.adapter:add", "remove": "llmgw.cli.adapter:remove",
                                "list": "llmgw.cli.adapter:list_adapters"})
def adapter() -> None:
    """LoRA adapters on a declared base model: add, remove, list."""


@ctl.group(cls=LazyGroup, lazy={"cordon": "llmgw.cli.nodes:cordon", "drain": "llmgw.cli.nodes:drain",
                                "uncordon": "llmgw.cli.nodes:uncordon", "retire": "llmgw.cli.nodes:retire"})
def node() -> None:
    """Node maintenance: cordon, drain, uncordon; retire a node that is gone for good."""


@ctl.group(cls=LazyGroup, lazy={"create": "llmgw.cli.keys:create", "list": "llmgw.cli.keys:list_keys",
                                "show": "llmgw.cli.keys:show", "update": "llmgw.cli.keys:update",
                                "revoke": "llmgw.cli.keys:revoke", "import": "llmgw.cli.keys:import_keys"})
def key() -> None:
    """API keys as events: create (the secret is printed once), import many, list, show, update, revoke (admin)."""
