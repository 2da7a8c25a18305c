"""The CLI's library: what ``llmgw ctl`` asks, decides and publishes. The CLI only parses and formats.

* ``ask``: status, the model list and one model, idle replicas, the stored history
  (from the projector's status service, or folded here with ``--replay``);
* ``plan``: a plan here against a fleet file or from the running planner, and the
  candidate ``deploy`` chooses;
* ``declare``: declarations (``deploy``, ``apply``), stops, keys, retired nodes,
  injected faults, and ``up``'s first model;
* ``adapters``: LoRA adapters declared on a base (``ctl adapter add``), removed, listed;
* ``files``: model files on nodes: prefetch requests, pins, where each model's files are.

Every function opens its own short-lived bus connection (``reconnect=False``: a
command that cannot reach NATS says so at once) and closes it. Heavy imports (the
bus, DuckDB, the planner) happen inside the functions, so a command pays only for
what it uses.
"""

from llmgw.ctl import adapters, files
from llmgw.ctl.ask import (
    CATCH_UP_S,
    STATUS_WAIT_S,
    Entry,
    Notice,
    Progress,
    connect,
    fetch_idle,
    fetch_status,
    first_stored,
    involves_model,
    involves_node,
    list_models,
    live_usage,
    read_entries,
    replay_state,
    show_model,
    stream_heads,
)
from llmgw.ctl.declare import (
    DERIVED,
    Declaration,
    cordon_node,
    declare,
    inject_fault,
    key_digest,
    keys,
    new_key_secret,
    prepare_up,
    publish_control,
    publish_key,
    retire_node,
    spec_changes,
    stop_idle,
)
from llmgw.ctl.plan import choose, gguf_file, local_model, plan, plan_locally, plan_remotely

__all__ = [
    "CATCH_UP_S", "DERIVED", "adapters", "files", "STATUS_WAIT_S", "Declaration", "Entry", "Notice", "Progress", "choose", "connect", "cordon_node",
    "declare", "fetch_idle", "fetch_status", "first_stored", "gguf_file", "inject_fault", "involves_model",
    "involves_node", "key_digest", "keys", "list_models", "live_usage", "local_model", "new_key_secret", "plan", "plan_locally",
    "plan_remotely", "prepare_up", "publish_control", "publish_key", "read_entries", "replay_state", "retire_node",
    "show_model", "spec_changes", "stop_idle", "stream_heads",
]
