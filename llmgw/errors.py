"""Every error llmgw raises on purpose, rooted at one class.

    LlmgwError
    ├── ConfigError            a settings, fleet or model file that cannot be used
    │   └── FleetFileError     a fleet file with a bad field (file, field, value)
    ├── BusError               anything between us and NATS
    │   ├── ConnectError       server unreachable, wrong credentials, TLS mismatch
    │   ├── PermissionDeniedError   the server refused a subject for these credentials
    │   ├── PublishError       a publish that was not acknowledged in time
    │   └── OutboxFullError    the bounded outbox cannot take another event
    ├── ServerError            the embedded nats-server could not start (port taken, no binary)
    ├── ModelError             a model whose config or size cannot be read
    ├── PlanError              a plan request that makes no sense (tp 3 for 64 heads, …)
    ├── ProjectionError        a projector that must stop (disk full, DuckDB file locked)
    ├── ServiceError           an error reply from one of our NATS services
    │   └── NoServiceError     nobody serves the subject (not started, or gone)
    └── NvmlError              the NVML driver is missing or failed

Messages carry the numbers and the next step; the CLI prints them as
``Error: …`` with exit status 1.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Root of every error llmgw raises on purpose."""


class ConfigError(LlmgwError):
    """A settings, fleet or model file that cannot be used."""


class FleetFileError(ConfigError):
    """A fleet file with a bad field; the message names file, field and value."""

    def __init__(self, path: str, field: str, problem: str) -> None:
        self.path, self.field, self.problem = path, field, problem
        super().__init__(f"{path}: {field} {problem}" if field else f"{path}: {problem}")


class BusError(LlmgwError):
    """Anything between us and NATS."""


class ConnectError(BusError):
    """The server is unreachable, refused the credentials, or TLS failed."""


class PermissionDeniedError(BusError):
    """The server refused a subject for these credentials."""


class PublishError(BusError):
    """A publish that was not acknowledged in time."""


class OutboxFullError(BusError):
    """The bounded outbox cannot take another event."""


class ServerError(LlmgwError):
    """The embedded nats-server could not start or stop."""


class ModelError(LlmgwError):
    """A model whose config or size cannot be read."""


class PlanError(LlmgwError):
    """A plan request that makes no sense."""


class ProjectionError(LlmgwError):
    """A projector that must stop; its checkpoint is intact."""


class ServiceError(LlmgwError):
    """An error reply from one of our NATS services."""


class NoServiceError(ServiceError):
    """Nobody serves the subject: a caller with another way to the answer may take it."""


class NvmlError(LlmgwError):
    """The NVML driver is missing or failed."""
