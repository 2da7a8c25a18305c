"""The fleet file: the shipped example loads, and every mistake is one line naming file, field, value."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw import fleetfile
from llmgw.errors import FleetFileError
from llmgw.fleet.state import fold

AT = datetime(2026, 11, 1, tzinfo=UTC)

GOOD = """
[[nodes]]
name = "n1"
fabric = "ib-a"
gpu_class = "H100-80GB"
gpu_count = 8
gpu_memory_mib = 81559
"""


def test_example_fleet_is_realistic(fleet_file: Path) -> None:
    fleet = fleetfile.load(fleet_file)
    by_class: dict[str, set[str]] = {}
    for n in fleet.nodes:
        by_class.setdefault(n.gpu_class, set()).add(n.fabric)
    assert len(by_class["H100-80GB"]) >= 2  # two fabrics of H100s
    assert "A100-40GB" in by_class and "L40S-48GB" in by_class
    assert sum(1 for n in fleet.nodes if n.unhealthy) == 1


def test_inventories_fold_into_a_fleet_with_the_bad_gpu(fleet_file: Path) -> None:
    fleet = fleetfile.load(fleet_file)
    state = fold(fleetfile.inventories(fleet, AT))
    gpus = list(state.gpus())
    assert len(gpus) == sum(n.gpu_count for n in fleet.nodes)
    bad = [g for g in gpus if not g.healthy]
    assert [(g.node, g.index) for g in bad] == [("h100-a-03", 3)]
    assert len({g.uuid for g in gpus}) == len(gpus)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("gpu_count = 8", "gpu_count = 0"), "f.toml: nodes[0].gpu_count must be a positive integer of at most 64 (got 0)"),
        (GOOD.replace("gpu_count = 8", 'gpu_count = "8"'), "f.toml: nodes[0].gpu_count must be a positive integer of at most 64 (got '8')"),
        (GOOD.replace('gpu_class = "H100-80GB"', 'gpu_class = "H100"'), "f.toml: nodes[0].gpu_class must be a GPU class like H100-80GB (model, '-', memory in GB) (got 'H100')"),
        (GOOD.replace('fabric = "ib-a"\n', ""), "f.toml: nodes[0].fabric is missing"),
        (GOOD + 'unhealthy = [9]\n', "f.toml: nodes[0].unhealthy[0] must be a GPU index from 0 to 7 (got 9)"),
        (GOOD + 'gpus = 8\n', "f.toml: nodes[0].gpus is not a known field (known: fabric, gpu_class, gpu_count, gpu_memory_mib, gpu_name, name, unhealthy, vllm_version)"),
        (GOOD + GOOD, "f.toml: nodes[1].name repeats node 'n1'"),
        (GOOD + '"gpu\\ncount" = 8\n', "f.toml: nodes[0].'gpu\\ncount' is not a known field (known: fabric, gpu_class, gpu_count, "
                                        "gpu_memory_mib, gpu_name, name, unhealthy, vllm_version)"),
        (GOOD.replace("81559", "12"), "f.toml: nodes[0].gpu_memory_mib must be a whole number of MiB between 1024 and 4194304 (got 12)"),
        ("nodes = 3", "f.toml: nodes must be an array of 1 to 10,000 tables ([[nodes]]) (got 3)"),
        ("", "f.toml: nodes is missing; it must be an array of 1 to 10,000 tables ([[nodes]])"),
        ("nodes = []", "f.toml: nodes must be an array of 1 to 10,000 tables ([[nodes]]) (got [])"),
        ("nodes = [1]", "f.toml: nodes[0] must be a table (got 1)"),
        ("nodes = [[[[1]]]]", "f.toml: nodes[0] must be a table (got an array of 1)"),
        (GOOD.replace("gpu_count = 8", "gpu_count = true"), "f.toml: nodes[0].gpu_count must be a positive integer of at most 64 (got True)"),
        (GOOD.replace("gpu_count = 8", "gpu_count = 8.0"), "f.toml: nodes[0].gpu_count must be a positive integer of at most 64 (got 8.0)"),
        (GOOD.replace("81559", "2048.0"), "f.toml: nodes[0].gpu_memory_mib must be a whole number of MiB between 1024 and 4194304 (got 2048.0)"),
        (GOOD + "unhealthy = 3\n", "f.toml: nodes[0].unhealthy must be an array of GPU indices (got 3)"),
        (GOOD + "unhealthy = [1, -1]\n", "f.toml: nodes[0].unhealthy[1] must be a GPU index from 0 to 7 (got -1)"),
        (GOOD + 'unhealthy = ["a"]\n', "f.toml: nodes[0].unhealthy[0] must be a GPU index from 0 to gpu_count - 1 (got 'a')"),
        (GOOD.replace('"n1"', '"n 1"'), "f.toml: nodes[0].name must be 1 to 128 letters, digits, '.', '_' or '-', "
                                        "starting with a letter or digit (got 'n 1')"),
        (GOOD + f'gpu_name = "{"x" * 300}"\n', "f.toml: nodes[0].gpu_name must be a GPU name of at most 200 characters (got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'… (300 characters))"),
        (GOOD + 'vllm_version = "abc"\n', "f.toml: nodes[0].vllm_version must be a version such as \"0.17.1\" (got 'abc')"),
        (GOOD + "vllm_version = 17\n", "f.toml: nodes[0].vllm_version must be a version such as \"0.17.1\" (got 17)"),
    ],
)
def test_each_mistake_is_one_line_with_file_field_value(text: str, message: str) -> None:
    with pytest.raises(FleetFileError) as err:
        fleetfile.parse(text, "f.toml")
    assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_a_fleet_of_more_than_max_nodes_is_one_line() -> None:
    text = "".join(GOOD.replace('"n1"', f'"n{i}"') for i in range(fleetfile.MAX_NODES + 1))
    with pytest.raises(FleetFileError) as err:
        fleetfile.parse(text, "f.toml")
    assert str(err.value) == "f.toml: nodes must be an array of 1 to 10,000 tables ([[nodes]]) (got an array of 10,001)"


def test_deep_nesting_is_one_line() -> None:
    """tomllib raises RecursionError on it: a traceback unless caught."""
    with pytest.raises(FleetFileError) as err:
        fleetfile.parse("nodes = " + "[" * 100_000 + "]" * 100_000, "f.toml")
    assert str(err.value) == "f.toml: is nested too deeply to be a fleet file"


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FleetFileError, match=r"^f.toml: is not valid TOML"):
        fleetfile.parse("[[nodes]\n", "f.toml")
    with pytest.raises(FleetFileError, match="does not exist"):
        fleetfile.load(tmp_path / "nope.toml")


def test_node_lookup_names_the_known_nodes() -> None:
    fleet = fleetfile.parse(GOOD, "f.toml")
    with pytest.raises(FleetFileError, match=r"has no node named 'n9' \(nodes: n1\)"):
        fleet.node("n9")


def test_cli_shows_fleet_errors_without_traceback(tmp_path: Path) -> None:
    """The CLI path every command takes: an LlmgwError becomes `Error: …`, exit 1."""
    import click

    from llmgw.cli.options import LazyGroup

    @click.group(cls=LazyGroup)
    def grp() -> None:
        pass

    @grp.command()
    @click.argument("path")
    def check(path: str) -> None:
        fleetfile.load(path)

    bad = tmp_path / "fleet.toml"
    bad.write_text(GOOD.replace("gpu_count = 8", "gpu_count = -2"))
    result = CliRunner().invoke(grp, ["check", str(bad)])
    assert result.exit_code == 1
    assert result.output == f"Error: {bad}: nodes[0].gpu_count must be a positive integer of at most 64 (got -2)\n"
