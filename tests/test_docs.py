"""Docs that cannot drift: every command a page shows exists, parses, and runs where it can.

* ``docs/cli.md`` is what every command's ``--help`` prints (``scripts/cli_reference.py`` writes it).
* Every ``llmgw …`` command line in a fenced code block of README.md and docs/*.md names a
  command that exists, and its options parse: click resolves the subcommands, then each
  level's ``make_context``. Shell around it is read as a shell would (pipes, ``&&``, ``;``,
  ``&``, redirections, ``#`` comments, ``\\`` continuations, ``VAR=value`` before it,
  ``$(…)``); a ``# llmgw …`` comment is a command too (an alternative a reader uncomments);
  ``[--flag x]`` is the flag; placeholders (``NAME``, ``MODEL``, ``P``…) stand for an example
  value. A file a page names that is the reader's own (``keys.sha256``, ``my-fleet.toml``)
  is stood in for by one that exists; a repository path (``examples/…``) must exist.
* The commands that run offline, without a control plane, are run, a page's in order, in a
  temporary directory that links the repository's ``examples``, ``tests``, ``scripts``,
  ``benchmarks`` and ``docs`` (so their paths resolve as from the repository root and what
  they write lands in the temporary directory): ``ctl model plan --fleet``,
  ``demo-model``, ``nats-conf``, every ``--help``, and shell completion. Each must exit 0,
  print JSON for ``--json``, and, where the page shows its output (a ``console`` block:
  ``$ llmgw …`` and the lines under it, ``…`` eliding lines or a line's middle), print those
  lines in that order. A plan whose model is the reader's own, or would come from the
  Hugging Face Hub, only parses here.
* The commands that need a running control plane only parse here. The walkthrough's
  (``up --simulate``, plan and deploy, requests through the router, an XID under the
  replica, idle stop, the wake, what-if) are run as written, in order, by
  tests/test_walkthrough.py (and the same loop, asserted closely, by tests/test_e2e.py); the real engine's
  five commands by tests/test_e2e_llama.py; the others by their own modules (test_cli_*,
  test_router*, test_keys, test_whatif, test_dashboard, test_natsconf…).
* Every relative link goes to a file that exists, and every anchor to a heading of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ("examples", "tests", "scripts", "benchmarks", "docs")  # what a run's directory links to

_spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
assert _spec and _spec.loader
cli_reference = importlib.util.module_from_spec(_spec)
sys.modules["cli_reference"] = cli_reference
_spec.loader.exec_module(cli_reference)


def test_the_cli_reference_is_what_every_help_says() -> None:
    # In a fresh interpreter, as a person's `llmgw … --help` runs: click keeps a command's help option
    # once made, so one test that invoked a command on its own (its help only `--help`) would change
    # what this process renders for it.
    written = (ROOT / "docs" / "cli.md").read_text()
    fresh = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'scripts'); import cli_reference; "
                            "sys.stdout.write(cli_reference.render())"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
    assert fresh.returncode == 0, fresh.stderr
    assert written == fresh.stdout, (
        "docs/cli.md is not what the commands' --help prints; run `python scripts/cli_reference.py` and commit it")


def test_the_cli_reference_reaches_the_lazy_groups_subcommands() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    titles = [line[3:] for line in page.splitlines() if line.startswith("## ")]
    assert len(titles) == len(set(titles))
    assert {"llmgw", "llmgw ctl model plan", "llmgw ctl key create", "llmgw agent fault", "llmgw up"} <= set(titles)


# --- the commands in the pages ------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
_SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_OPERATORS = {"|", "||", "&&", ";", "&"}
# What a page's placeholders stand for, as a reader would fill them in.
_PLACEHOLDERS = {
    "NAME": "coder", "MODEL": "Qwen/Qwen2.5-Coder-32B-Instruct", "REPLICA": "coder-r1", "NODE": "h100-a-01",
    "GPU": "3", "KIND": "clear", "H": "127.0.0.1", "P": "2", "N": "2", "M": "4", "K": "4", "R": "2", "C": "8192",
    "FILE": "examples/fleet.toml", "FLEET": "examples/fleet.toml", "DIR": "examples/models", "D": "llmgw-data",
    "URL": "nats://127.0.0.1:4222", "TIME": "2h", "SIZE": "32MiB", "F": "0.9", "V": "0.17.1", "TOKENS": "8192",
}


@dataclass
class Shown:
    """A shell line of a page's fenced block, and the output a ``console`` block shows under it."""

    page: str
    lineno: int
    text: str
    console: bool
    output: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Command:
    """One ``llmgw`` invocation in a shell line: its ``VAR=value`` prefix and its arguments."""

    line: Shown
    env: dict[str, str]
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.line.page}:{self.line.lineno}: {self.line.text}"


def fenced_lines(page: Path) -> Iterator[Shown]:
    """Every shell line of the page's fenced blocks (continuations joined), with a console block's output."""
    name = str(page.relative_to(ROOT))
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, i = m.group(1), m.group(2), i + 1
        current: Shown | None = None
        while i < len(lines) and not lines[i].strip().startswith(fence):
            no, text = i + 1, lines[i].strip()
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            i += 1
            if lang == "console":
                if text.startswith("$ "):
                    current = Shown(name, no, text[2:], True)
                    yield current
                elif current is not None:
                    current.output.append(text)
                continue
            for prompt in ("$ ", "# "):
                if text.startswith(prompt + "llmgw "):
                    text = text[len(prompt):]
            yield Shown(name, no, text, False)
        i += 1


def invocations(text: str) -> Iterator[tuple[dict[str, str], list[str]]]:
    """The ``llmgw`` commands a shell line runs, ``$(…)`` included."""
    for inner in _SUBSTITUTION.findall(text):
        yield from invocations(inner)
    lexer = shlex.shlex(_SUBSTITUTION.sub("x", text), posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    words: list[list[str]] = [[]]
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: prose in a block (help text), unless it begins with llmgw
        if text.split()[0].endswith("llmgw"):
            raise
        return
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in _OPERATORS:
            words.append([])
        elif token[0] in "<>":  # a redirection and its target (and the descriptor before it)
            if words[-1] and words[-1][-1].isdigit():
                words[-1].pop()
            i += 1
        else:
            words[-1].append(token)
        i += 1
    for w in words:
        env: dict[str, str] = {}
        while w and _ASSIGNMENT.match(w[0]):
            key, _, value = w.pop(0).partition("=")
            env[key] = value
        if w and (w[0] == "llmgw" or w[0].endswith("/llmgw")):
            yield env, w[1:]


def as_argument(word: str) -> str:
    """A template's word as a reader would type it: ``[--flag`` is the flag, a placeholder its example."""
    if word.startswith("[") or word.endswith("]"):
        word = word.strip("[]")
    return _PLACEHOLDERS.get(word, word)


def commands(page: Path) -> list[Command]:
    out = []
    for line in fenced_lines(page):
        if "llmgw" in line.text:
            for env, words in invocations(line.text):
                out.append(Command(line, env, tuple(as_argument(w) for w in words if w.strip("[]"))))
    return out


ALL = {str(p.relative_to(ROOT)): commands(p) for p in PAGES}


def test_the_pages_are_read_for_their_commands() -> None:
    """A guard for the reader above: the pages' commands are found (a broken parser finds none)."""
    found = {name: len(cmds) for name, cmds in ALL.items()}
    assert found["README.md"] >= 20 and found["docs/planning.md"] >= 5 and found["docs/cli.md"] >= 40, found
    argvs = [c.argv for cmds in ALL.values() for c in cmds]
    assert ("ctl", "model", "show", "coder") in argvs  # the walkthrough's
    assert ("fake-engine", "--host", "127.0.0.1", "--port", "2", "--model", "coder", "--name", "coder-r1") in argvs


# --- parsing ------------------------------------------------------------------------------------------


def _is_repository_path(value: str) -> bool:
    parts = Path(value).parts
    return not Path(value).is_absolute() and bool(parts) and (ROOT / parts[0]).exists() and parts[0] != "."


def _stand_in(param: click.Parameter | None) -> str:
    """An existing path of the kind ``param`` takes, for a file that is the reader's own."""
    kind = param.type if param is not None else None
    wants_dir = isinstance(kind, click.Path) and not kind.file_okay
    return str(ROOT / ("examples" if wants_dir else "pyproject.toml"))


def parse(argv: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, object], list[str]]:
    """Resolve and parse ``llmgw ARGV`` as click would: (command path, its params, the reader's files stood in).

    Raises click.UsageError (click.BadParameter …) for what click would refuse.
    """
    args, stood_in = list(argv), []
    for _ in range(len(args) + 1):
        try:
            return (*_parse(args), stood_in)
        except click.BadParameter as e:
            missing = re.search(r"(?:File|Directory|Path) '([^']*)' does not exist", e.format_message())
            if missing is None or _is_repository_path(missing.group(1)) or missing.group(1) not in _values(args):
                raise
            value = missing.group(1)
            stood_in.append(value)
            args = [_stand_in(e.param) if a == value else a.replace(f"={value}", f"={_stand_in(e.param)}")
                    for a in args]
    raise AssertionError(f"no end to the stand-ins for {argv}")


def _values(args: list[str]) -> set[str]:
    return {*args, *(a.partition("=")[2] for a in args if a.startswith("--"))}


def _parse(args: list[str]) -> tuple[tuple[str, ...], dict[str, object]]:
    cmd: click.Command = cli
    path: tuple[str, ...] = ()
    parent: click.Context | None = None
    while True:
        try:
            ctx = cmd.make_context(" ".join(("llmgw", *path)), list(args), parent=parent, resilient_parsing=False)
        except click.exceptions.Exit:  # --help, --version: eager, and fine
            return path, {}
        if not isinstance(cmd, click.Group):
            return path, dict(ctx.params)
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            if not cmd.invoke_without_command:
                raise click.UsageError("Missing command.", ctx)
            return path, dict(ctx.params)
        name, sub, args = cmd.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        cmd, path, parent = sub, (*path, name), ctx


@pytest.mark.parametrize("page", list(ALL), ids=list(ALL))
def test_every_command_a_page_shows_exists_and_parses(page: str) -> None:
    refused = []
    for c in ALL[page]:
        if "_LLMGW_COMPLETE" in c.env:
            continue  # shell completion reads no command line: it is run below
        try:
            parse(c.argv)
        except click.UsageError as e:
            refused.append(f"{c.where}\n    Error: {e.format_message()}")
    assert not refused, f"{page} shows commands llmgw refuses:\n" + "\n".join(refused)


# --- running what runs offline ------------------------------------------------------------------------


MODELS_DIR = str(ROOT / "examples" / "models")  # the walkthrough's `export LLMGW_MODELS_DIR=$PWD/examples/models`
_WRITTEN = ("directory", "out", "env_file")  # demo-model DIR, nats-conf -o and --env-file


def _written(params: dict[str, object]) -> list[str]:
    return [os.path.normpath(str(w)) for k in _WRITTEN if (w := params.get(k)) is not None]


def _plan_runs_offline(params: dict[str, object], env: dict[str, str], written: set[str]) -> bool:
    """A plan against a fleet file of a model read here: a directory (the repository's, or one an earlier
    command wrote), or Org/Name as Org__Name under the models directory; not the reader's, not the Hub's."""
    if params.get("fleet_path") is None:
        return False
    model = str(params["model"])
    if os.path.normpath(model) in written or (not Path(model).is_absolute() and (ROOT / model).is_dir()):
        return True
    models_dir = ROOT / str(params.get("models_dir") or env.get("LLMGW_MODELS_DIR") or MODELS_DIR)
    return "/" in model and (models_dir / model.replace("/", "__", 1)).is_dir()


def offline(page: str) -> list[Command]:
    """The page's commands that run here without a control plane, in the page's order."""
    out: list[Command] = []
    written: set[str] = set()
    for c in ALL[page]:
        if "_LLMGW_COMPLETE" in c.env:
            out.append(c)
            continue
        try:
            path, params, stood_in = parse(c.argv)
        except click.UsageError:
            continue  # the parse test says why
        if stood_in:
            continue  # it reads a file of the reader's
        if "--help" in c.argv or "-h" in c.argv or path in (("demo-model",), ("nats-conf",)) or (
                path == ("ctl", "model", "plan") and _plan_runs_offline(params, {**c.env}, written)):
            out.append(c)
            written.update(_written(params))
    return out


def shows(output: str, shown: list[str]) -> str | None:
    """The first shown line the output lacks, in order (``…`` elides lines, or a line's middle), or None."""
    lines = [ln.strip() for ln in output.splitlines()]
    at = 0
    for want in (s.strip() for s in shown):
        if not want or want == "…":
            continue
        pattern = re.compile(".*".join(re.escape(part.strip()) for part in want.split("…")))
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def run_env(tmp: Path, c: Command) -> dict[str, str | None]:
    """A reader's shell: no llmgw settings of this machine's, models from examples/ (the walkthrough's export)."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("LLMGW_", "NATS_", "_LLMGW"))}
    env.update(LLMGW_DATA_DIR=str(tmp / "data"), LLMGW_MODELS_DIR=MODELS_DIR, HF_HUB_OFFLINE="1")
    env.update(c.env)
    return env


@pytest.mark.parametrize("page", list(ALL), ids=list(ALL))
def test_what_runs_offline_runs_as_the_page_shows(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    failed = []
    runs = {id(c) for c in offline(page)}
    for c in ALL[page]:
        if id(c) not in runs:
            if c.line.console and c.line.output:
                failed.append(f"{c.where}\n    a console block shows its output, but it cannot run here: use a bash block")
            continue
        params = {} if "_LLMGW_COMPLETE" in c.env else parse(c.argv)[1]
        writes = [Path(w) for w in _written(params)]
        assert not [w for w in writes if w.is_absolute() or w.parts[0] in LINKED], \
            f"{c.where} would write outside its temporary directory: {writes}"
        env = run_env(tmp_path, c)
        completing = c.env.get("_LLMGW_COMPLETE")
        res = CliRunner().invoke(cli, [] if completing else list(c.argv), prog_name="llmgw", env=env)
        if res.exit_code != 0:
            failed.append(f"{c.where}\n    exit {res.exit_code}: {res.output.strip()[-600:] or res.exception!r}")
            continue
        if completing and "llmgw" not in res.output:
            failed.append(f"{c.where}\n    no completion script: {res.output[:200]!r}")
        if "--json" in c.argv:
            try:
                json.loads(res.output)
            except ValueError as e:
                failed.append(f"{c.where}\n    --json printed no JSON ({e}): {res.output[:200]!r}")
        if (lacking := shows(res.output, c.line.output)) is not None:
            failed.append(f"{c.where}\n    the page shows a line it does not print:\n    {lacking}\n"
                          f"    it printed:\n" + "\n".join("    " + ln for ln in res.output.splitlines()[:40]))
    assert not failed, f"{page}: commands that do not run as shown:\n" + "\n".join(failed)


def test_the_offline_commands_are_found_and_run() -> None:
    """A guard for the rule above: the commands meant to run here are the ones it picks."""
    picked = [(page, c.argv[:3]) for page in ALL for c in offline(page)]
    assert ("docs/planning.md", ("ctl", "model", "plan")) in picked
    assert sum(p == "docs/planning.md" for p, _ in picked) >= 4
    assert ("docs/engines.md", ("demo-model", "./models/tiny")) in picked
    assert ("docs/engines.md", ("ctl", "model", "plan")) in picked  # the model demo-model wrote just above it
    assert ("docs/install.md", ()) in picked  # shell completion
    assert ("docs/cli.md", ("nats-conf", "--fleet", "examples/fleet.toml")) in picked
    not_picked = [c.argv[:3] for page in ALL for c in ALL[page] if all(c is not o for o in offline(page))]
    assert ("ctl", "status") in not_picked and ("up", "--simulate", "examples/fleet.toml") in not_picked
    assert ("ctl", "model", "plan") in not_picked  # the walkthrough's, which asks the running planner


# --- links --------------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`\n]*`")


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    out, inside = [], ""
    for line in page.read_text().splitlines():
        m = _FENCE.match(line)
        if m and (not inside or line.strip().startswith(inside)):
            inside = "" if inside else m.group(1)
            continue
        if not inside:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings (a repeated one gets -1, -2…)."""
    seen: dict[str, int] = {}
    for line in prose(page):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line):
            slug = cli_reference.anchor(m.group(1).replace("`", ""))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
    heads = set(seen)
    heads |= {f"{s}-{i}" for s, n in seen.items() for i in range(1, n)}
    return heads


def test_every_link_goes_to_a_page_and_a_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for line in prose(page):
            for target in _LINK.findall(_CODE.sub("", line)):
                if re.match(r"^[a-z]+:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links to nowhere:\n" + "\n".join(broken)


def test_a_client_the_readme_uses_is_installed_by_the_quick_start_or_the_readme_says_how() -> None:
    """Issue 43, smaller: the walkthrough used the `openai` client, which the quick start does not install."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = {re.split(r"[\[<>=;! ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    used = set(re.findall(r"the `([\w-]+)` (?:client|package|library)", readme))
    used |= set(re.findall(r"^\s*(?:import|from) ([\w]+)", readme, flags=re.M))
    assert "openai" in used
    pips = " ".join(re.findall(r"pip install[^\n`]*", readme))
    missing = [p for p in sorted(used) if p.lower() not in installed and p != "llmgw" and not re.search(
        rf"(?<![\w.-]){re.escape(p)}(?![\w-])", pips)]
    assert missing == [], f"the README uses {missing} but neither the quick start nor a `pip install` there installs them"
