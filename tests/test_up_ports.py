"""``llmgw up`` checks every port it binds before it starts anything (issue 43 #5): a router or
dashboard port in use is one ``Error:`` naming the option of ``up`` that moves it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli


@pytest.fixture
def busy() -> Iterator[int]:
    """A port someone else's server listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("option", ["--router-listen", "--dashboard-listen"])
def test_a_port_in_use_is_one_error_naming_ups_option(busy: int, option: str, tmp_path: Path) -> None:
    others = {"--router-listen": "127.0.0.1:0", "--dashboard-listen": "127.0.0.1:0"}
    others[option] = f"127.0.0.1:{busy}"
    r = CliRunner().invoke(cli, ["up", "--data-dir", str(tmp_path), "--port", "0",
                                 *(a for k, v in others.items() for a in (k, v))])
    assert r.exit_code == 1, r.output
    assert r.output == (f"Error: {option} 127.0.0.1:{busy}: the port is already in use (another llmgw up, "
                        f"router or dashboard?); stop what holds it, or give {option} HOST:PORT with another "
                        "port (port 0: a free one)\n")
    assert not (tmp_path / "nats").exists()  # nothing was started


def test_the_router_and_the_dashboard_on_one_port_is_refused(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["up", "--data-dir", str(tmp_path), "--port", "0", "--router-listen",
                                 "127.0.0.1:18181", "--dashboard-listen", "127.0.0.1:18181"])
    assert r.exit_code == 1, r.output
    assert r.output == ("Error: --router-listen and --dashboard-listen both say 127.0.0.1:18181; give the "
                        "dashboard another port\n")


def test_up_with_real_engines_points_at_the_demo_model_not_a_14b() -> None:
    from llmgw.cli.up import look_line

    assert "./models/tiny" in look_line("real") and "14B" not in look_line("real")
    assert "Qwen/Qwen2.5-14B-Instruct" in look_line("fake")
