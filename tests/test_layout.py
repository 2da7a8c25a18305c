"""The house by process: which package owns what, what each shows, and the one import rule.

Read from the source (``ast``), never run: the CLI imports only each package's public face
(``__all__``), the core (messages, subjects, bus, fleet) imports no service, ``llmgw/``
holds packages and a few shared modules, and no module grows past its size without a
stated reason. docs/architecture.md draws what these tests hold.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LLMGW = ROOT / "llmgw"
PACKAGES = ("messages", "bus", "fleet", "engine", "planner", "scheduler", "router", "agent", "dashboard", "whatif", "ctl")
SHARED = {"errors", "config", "subjects", "fleetfile", "clientsockets", "apikeys", "proc"}  # what every process shares
CORE = {"messages", "subjects", "bus", "fleet"}
SERVICES = {"engine", "planner", "scheduler", "router", "agent", "dashboard", "whatif", "ctl", "projections", "cli"}
MAX_LINES, REASON_OVER = 800, 600
REASON = "Over 600 lines:"  # a module longer than REASON_OVER says why in its docstring, after these words


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every ``from X import names`` / ``import X`` in a file: (line, module, names)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
    return out


def _face(package: str) -> set[str]:
    return set(importlib.import_module(package).__all__)


def test_the_cli_imports_only_public_faces() -> None:
    faces = {f"llmgw.{p}": _face(f"llmgw.{p}") for p in (*PACKAGES, "projections")}
    wrong = []
    for path in sorted((ROOT / "cli").glob("*.py")):
        for line, module, names in _imports(path):
            where = f"cli/{path.name}:{line}"
            if not module.startswith("llmgw") or module.startswith("llmgw.cli"):
                continue
            if module == "llmgw":
                wrong += [f"{where}: llmgw.{n} is no package's face" for n in names
                          if n not in (*PACKAGES, *SHARED, "__version__")]
            elif module in faces:
                wrong += [f"{where}: {module} does not show {n} (not in its __all__)" for n in names
                          if n not in faces[module]]
            elif module.removeprefix("llmgw.") in SHARED:
                wrong += [f"{where}: {module}.{n} is private" for n in names if n.startswith("_")]
            else:
                wrong.append(f"{where}: {module} is inside a package; import from its face "
                             f"({module.rsplit('.', 1)[0]})")
    assert not wrong, "\n".join(wrong)


def test_the_cli_imports_no_private_name_of_its_own_modules() -> None:
    wrong = [f"cli/{path.name}:{line}: {module}.{n}" for path in sorted((ROOT / "cli").glob("*.py"))
             for line, module, names in _imports(path) if module.startswith("llmgw.cli")
             for n in names if n.startswith("_")]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", [*PACKAGES, "projections"])
def test_every_name_a_face_shows_is_there(package: str) -> None:
    mod = importlib.import_module(f"llmgw.{package}")
    assert mod.__all__ and mod.__doc__, f"llmgw.{package} names no public face"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"llmgw.{package}.__all__ names what it does not have: {missing}"
    lazy = getattr(mod, "_FACE", None)
    if lazy is not None:  # a lazy face's map and its __all__ are one list
        assert sorted(lazy) == sorted(mod.__all__)


def test_the_core_imports_no_service() -> None:
    wrong = []
    for path in sorted(LLMGW.rglob("*.py")):
        top = path.relative_to(LLMGW).parts[0].removesuffix(".py")
        if top not in CORE:
            continue
        for line, module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] == "llmgw" and len(parts) > 1 and parts[1] in SERVICES:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "the core (messages, subjects, bus, fleet) imports no service:\n" + "\n".join(wrong)


def test_llmgw_holds_packages_and_a_few_shared_modules() -> None:
    modules = {p.stem for p in LLMGW.glob("*.py")} - {"__init__", "__main__"}
    packages = {p.name for p in LLMGW.iterdir() if (p / "__init__.py").is_file()}
    assert modules == SHARED and len(modules) <= 8
    assert packages == set(PACKAGES)


def test_no_module_grows_past_its_size_without_a_reason() -> None:
    wrong = []
    for path in sorted([*LLMGW.rglob("*.py"), *(ROOT / "projections").glob("*.py"), *(ROOT / "cli").glob("*.py")]):
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES:
            wrong.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES})")
        elif lines > REASON_OVER and REASON not in doc:
            wrong.append(f"{path.relative_to(ROOT)}: {lines} lines, and its docstring says no {REASON!r} why")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("package", "question", "answer"), [
    ("scheduler", "Where a placement is decided", "placement.decide"),
    ("router", "Where a request is routed", "acquire"),
    ("planner", "Where the KV arithmetic is", "memory"),
    ("agent", "When an engine dies", "EngineRun"),
])
def test_a_newcomers_questions_are_answered_by_one_package(package: str, question: str, answer: str) -> None:
    doc = importlib.import_module(f"llmgw.{package}").__doc__ or ""
    assert question.lower() in doc.lower() and answer in doc, f"llmgw.{package}'s docstring does not answer {question!r}"
