"""The CLI's library: what ``llmgw ctl`` asks, decides and publishes. The CLI only parses and formats.

* ``ask``: status, the model list and one model, idle replicas, the stored history
  (from the projector's status service, or folded here with ``--replay``);
* ``plan``: a plan here against a fleet file or from the running planner, and the
  candidate ``deploy`` chooses;
* ``declare``: declarations (``deploy``, ``apply``), stops, keys, retired nodes,
  injected faults, and ``up``'s first model;
* ``adapters``: LoRA adapters declared on a base (``ctl adapter add``), removed, listed;
* ``files``: model files on nodes: prefetch requests, pins, where each model's files are.
* ``requests``: one request's line in the routers' access logs (``ctl request ID``).

Every function opens its own short-lived bus connection (``reconnect=False``: a
command that cannot reach NATS says so at once) and closes it. Heavy imports (the
bus, DuckDB, the planner) happen inside the functions, so a command pays only for
what it uses; the face is lazy for the same reason (``ctl status`` imports ``ask`` only).
``ask_status`` asks the projector over a blocking ``OneShot`` connection: no event loop,
no nats-py, for the read commands a person types most.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.ctl import adapters, files
    from llmgw.ctl.ask import (
        CATCH_UP_S,
        STATUS_WAIT_S,
        Entry,
        Notice,
        Progress,
        ask_status,
        connect,
        fetch_idle,
        fetch_status,
        first_stored,
        idle_now,
        involves_model,
        involves_node,
        list_models,
        list_models_now,
        live_usage,
        projector_usage,
        read_entries,
        replay_state,
        show_model,
        show_model_now,
        stream_heads,
    )
    from llmgw.ctl.requests import access_logs, find_request

# ``declare`` and ``plan`` are also the names of their modules: importing such a module would put it in
# the function's place, so these two are bound at once (neither imports anything heavy).
from llmgw.ctl.declare import (
    DERIVED,
    Declaration,
    cordon_node,
    declare,
    declare_many,
    inject_fault,
    key_digest,
    keys,
    new_key_secret,
    prepare_up,
    publish_control,
    publish_key,
    publish_keys,
    retire_node,
    spec_changes,
    stop_idle,
)
from llmgw.ctl.plan import (
    choose,
    gguf_file,
    local_model,
    plan,
    plan_locally,
    plan_many,
    plan_remotely,
)

_FACE = {
    "adapters": "llmgw.ctl.adapters",
    "files": "llmgw.ctl.files",
    "CATCH_UP_S": "llmgw.ctl.ask",
    "STATUS_WAIT_S": "llmgw.ctl.ask",
    "Entry": "llmgw.ctl.ask",
    "Notice": "llmgw.ctl.ask",
    "Progress": "llmgw.ctl.ask",
    "ask_status": "llmgw.ctl.ask",
    "idle_now": "llmgw.ctl.ask",
    "list_models_now": "llmgw.ctl.ask",
    "show_model_now": "llmgw.ctl.ask",
    "connect": "llmgw.ctl.ask",
    "fetch_idle": "llmgw.ctl.ask",
    "fetch_status": "llmgw.ctl.ask",
    "first_stored": "llmgw.ctl.ask",
    "involves_model": "llmgw.ctl.ask",
    "involves_node": "llmgw.ctl.ask",
    "list_models": "llmgw.ctl.ask",
    "live_usage": "llmgw.ctl.ask",
    "projector_usage": "llmgw.ctl.ask",
    "read_entries": "llmgw.ctl.ask",
    "replay_state": "llmgw.ctl.ask",
    "show_model": "llmgw.ctl.ask",
    "stream_heads": "llmgw.ctl.ask",
    "DERIVED": "llmgw.ctl.declare",
    "Declaration": "llmgw.ctl.declare",
    "cordon_node": "llmgw.ctl.declare",
    "declare": "llmgw.ctl.declare",
    "declare_many": "llmgw.ctl.declare",
    "inject_fault": "llmgw.ctl.declare",
    "key_digest": "llmgw.ctl.declare",
    "keys": "llmgw.ctl.declare",
    "new_key_secret": "llmgw.ctl.declare",
    "prepare_up": "llmgw.ctl.declare",
    "publish_control": "llmgw.ctl.declare",
    "publish_key": "llmgw.ctl.declare",
    "publish_keys": "llmgw.ctl.declare",
    "retire_node": "llmgw.ctl.declare",
    "spec_changes": "llmgw.ctl.declare",
    "stop_idle": "llmgw.ctl.declare",
    "access_logs": "llmgw.ctl.requests",
    "find_request": "llmgw.ctl.requests",
    "choose": "llmgw.ctl.plan",
    "gguf_file": "llmgw.ctl.plan",
    "local_model": "llmgw.ctl.plan",
    "plan": "llmgw.ctl.plan",
    "plan_locally": "llmgw.ctl.plan",
    "plan_many": "llmgw.ctl.plan",
    "plan_remotely": "llmgw.ctl.plan",
}
__all__ = [
    "idle_now", "list_models_now", "show_model_now",
    "CATCH_UP_S", "DERIVED", "Declaration", "Entry", "Notice", "Progress", "STATUS_WAIT_S", "access_logs", "adapters",
    "ask_status", "choose", "connect", "cordon_node", "declare", "declare_many", "fetch_idle", "fetch_status", "files",
    "find_request", "first_stored", "gguf_file", "inject_fault", "involves_model", "involves_node", "key_digest", "keys",
    "list_models", "live_usage", "local_model", "new_key_secret", "plan", "plan_locally", "plan_many",
    "plan_remotely",
    "prepare_up", "projector_usage", "publish_control", "publish_key", "publish_keys", "read_entries", "replay_state",
    "retire_node",
    "show_model", "spec_changes", "stop_idle", "stream_heads",
]
__getattr__ = lazy_face(__name__, _FACE)
