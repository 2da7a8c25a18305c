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


def test_up_help_names_xdg_data_home_and_the_data_dir_follows_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43, smaller: `up --help` omitted $XDG_DATA_HOME, where the data went when it was set."""
    from llmgw.config import data_dir

    r = CliRunner().invoke(cli, ["up", "--help"], terminal_width=200)
    assert r.exit_code == 0 and "$LLMGW_DATA_DIR, else $XDG_DATA_HOME/llmgw, else ~/.local/share/llmgw" in r.output
    monkeypatch.delenv("LLMGW_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert data_dir() == tmp_path / "llmgw"


def test_the_demo_models_the_readme_writes_in_the_checkout_are_ignored_by_git(tmp_path: Path) -> None:
    """Issue 43, smaller: `llmgw demo-model ./models/tiny` (the README's) left an untracked folder in the checkout."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parent.parent
    git = shutil.which("git")
    assert git is not None
    paths = ["models/tiny/model.gguf", "models/tiny-hf/config.json", "models/tiny/loras/sql.gguf"]
    r = subprocess.run([git, "-C", str(root), "check-ignore", "--no-index", *paths],
                       capture_output=True, text=True, check=False)
    assert r.stdout.split() == paths, r.stdout + r.stderr
    # and nothing the repository holds is under it (examples/models is the walkthrough's, tracked)
    r = subprocess.run([git, "-C", str(root), "check-ignore", "--no-index", "examples/models/Qwen__Qwen3-8B/config.json"],
                       capture_output=True, text=True, check=False)
    assert r.stdout == ""
