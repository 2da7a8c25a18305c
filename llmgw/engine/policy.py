"""What a declared spec may make an agent start: engine arguments from an allow-list, files from its stores.

A ``cli`` login can declare any ``ModelSpec``, and every agent runs what is placed on it: the
spec's ``engine_args`` land after llmgw's own (the engine takes the last of a repeated flag), and
its file becomes ``-m PATH``. So each engine's arguments are checked against the flags below, in
every form an engine parses (``--flag value``, ``--flag=value``, short forms, vLLM's
``--flag_name``); anything else, abbreviations and glued short forms included, is refused with the
flag named, unless the agent's operator allows it (``llmgw agent --allow-engine-arg FLAG``).
A value never starts with ``-`` unless it is a number, so no flag hides behind one. The files an
engine reads (a GGUF, a checkpoint's directory, a llama.cpp adapter) must resolve, links and
``..`` followed, inside the agent's model stores. ``ctl`` checks the arguments early, with the
same table; the agent's check is the one that holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw import messages as m

VALUE, FLAG, OPTIONAL = "value", "flag", "optional"  # takes a value; takes none; takes one only if it follows

# vLLM (``vllm serve``): what llmgw's own commands pass, and common tuning. Not here, among others:
# --host --port --uds --api-key --served-model-name --model --tokenizer --revision --download-dir
# --load-format --config --chat-template (a path it reads) --allowed-local-media-path --lora-modules
# --trust-remote-code --middleware --tool-parser-plugin --speculative-config --compilation-config
# --ssl-* --root-path --enable-sleep-mode --hf-overrides.
VLLM_ALLOWED: Mapping[str, str] = {
    "--tensor-parallel-size": VALUE, "--pipeline-parallel-size": VALUE, "--distributed-executor-backend": VALUE,
    "--quantization": VALUE, "--dtype": VALUE, "--kv-cache-dtype": VALUE, "--max-model-len": VALUE,
    "--max-num-seqs": VALUE, "--max-num-batched-tokens": VALUE, "--gpu-memory-utilization": VALUE,
    "--kv-cache-memory-bytes": VALUE, "--num-gpu-blocks-override": VALUE, "--block-size": VALUE,
    "--swap-space": VALUE, "--cpu-offload-gb": VALUE, "--seed": VALUE, "--max-logprobs": VALUE,
    "--max-seq-len-to-capture": VALUE, "--scheduling-policy": VALUE, "--max-num-partial-prefills": VALUE,
    "--long-prefill-token-threshold": VALUE, "--max-parallel-loading-workers": VALUE, "--reasoning-parser": VALUE,
    "--tool-call-parser": VALUE, "--limit-mm-per-prompt": VALUE, "--rope-scaling": VALUE, "--rope-theta": VALUE,
    "--uvicorn-log-level": VALUE, "--max-loras": VALUE, "--max-lora-rank": VALUE, "--max-cpu-loras": VALUE,
    "--enforce-eager": FLAG, "--enable-prefix-caching": FLAG, "--no-enable-prefix-caching": FLAG,
    "--enable-chunked-prefill": FLAG, "--no-enable-chunked-prefill": FLAG, "--disable-log-stats": FLAG,
    "--disable-log-requests": FLAG, "--enable-log-requests": FLAG, "--disable-custom-all-reduce": FLAG,
    "--enable-auto-tool-choice": FLAG, "--enable-expert-parallel": FLAG, "--enable-lora": FLAG,
    "--enable-prompt-tokens-details": FLAG, "--enable-force-include-usage": FLAG,
}
VLLM_SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-q": "--quantization"}

# llama.cpp's llama-server: what llmgw passes (-c -np -ngl), and common tuning. Not here, among others:
# -m --model -mu -hf --hf-repo --hf-file --hf-token --host --port --path --api-key --api-key-file --alias
# -a --log-file --lora --lora-scaled --slot-save-path --chat-template-file --grammar-file -f --mmproj
# --model-draft --rpc --props --ssl-key-file --ssl-cert-file --control-vector.
LLAMA_ALLOWED: Mapping[str, str] = {
    "--threads": VALUE, "--threads-batch": VALUE, "--ctx-size": VALUE, "--n-predict": VALUE, "--batch-size": VALUE,
    "--ubatch-size": VALUE, "--keep": VALUE, "--flash-attn": OPTIONAL, "--parallel": VALUE, "--n-gpu-layers": VALUE,
    "--split-mode": VALUE, "--tensor-split": VALUE, "--main-gpu": VALUE, "--cache-type-k": VALUE,
    "--cache-type-v": VALUE, "--numa": VALUE, "--cache-reuse": VALUE, "--temp": VALUE, "--top-k": VALUE,
    "--top-p": VALUE, "--min-p": VALUE, "--repeat-penalty": VALUE, "--seed": VALUE, "--rope-scaling": VALUE,
    "--rope-freq-base": VALUE, "--rope-freq-scale": VALUE, "--defrag-thold": VALUE, "--verbosity": VALUE,
    "--chat-template": VALUE, "--reasoning-format": VALUE, "--reasoning-budget": VALUE, "--timeout": VALUE,
    "--threads-http": VALUE, "--cache-ram": VALUE, "--device": VALUE, "--override-tensor": VALUE, "--prio": VALUE,
    "--mlock": FLAG, "--no-mmap": FLAG, "--cont-batching": FLAG, "--no-cont-batching": FLAG, "--metrics": FLAG,
    "--slots": FLAG, "--no-slots": FLAG, "--jinja": FLAG, "--no-jinja": FLAG, "--no-warmup": FLAG, "--swa-full": FLAG,
    "--context-shift": FLAG, "--no-context-shift": FLAG, "--no-kv-offload": FLAG, "--log-disable": FLAG,
}
LLAMA_SHORT = {
    "-t": "--threads", "-tb": "--threads-batch", "-c": "--ctx-size", "-n": "--n-predict", "--predict": "--n-predict",
    "-b": "--batch-size", "-ub": "--ubatch-size", "-fa": "--flash-attn", "-np": "--parallel",
    "-ngl": "--n-gpu-layers", "--gpu-layers": "--n-gpu-layers", "-sm": "--split-mode", "-ts": "--tensor-split",
    "-mg": "--main-gpu", "-ctk": "--cache-type-k", "-ctv": "--cache-type-v", "-cb": "--cont-batching",
    "-nocb": "--no-cont-batching", "-s": "--seed", "-dt": "--defrag-thold", "-lv": "--verbosity",
    "--log-verbosity": "--verbosity", "-to": "--timeout", "-cram": "--cache-ram", "-dev": "--device",
    "-ot": "--override-tensor", "-nkvo": "--no-kv-offload",
}
TABLES: Mapping[str, tuple[Mapping[str, str], Mapping[str, str]]] = {
    "vllm": (VLLM_ALLOWED, VLLM_SHORT), "llama.cpp": (LLAMA_ALLOWED, LLAMA_SHORT)}

# Why a flag often asked for is refused: the flag as written (canonical) → what it does.
_WHY = {
    **dict.fromkeys(("--host", "--port", "--uds", "--rpc", "--root-path"),
                    "it chooses where the engine listens (llmgw chooses that)"),
    **dict.fromkeys(("--api-key", "--api-key-file", "--hf-token", "--ssl-key-file", "--ssl-cert-file"),
                    "it sets the engine's keys or certificates"),
    **dict.fromkeys(("-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file",
                     "--tokenizer", "--revision", "--load-format", "--served-model-name", "--alias", "-a",
                     "--lora", "--lora-scaled", "--lora-modules", "--mmproj", "--model-draft", "-md",
                     "--speculative-config", "--download-dir"),
                    "it chooses what the engine serves or loads (the declaration does)"),
    **dict.fromkeys(("--path", "--log-file", "--slot-save-path", "--chat-template-file", "--grammar-file", "-f",
                     "--file", "--config", "--chat-template", "--allowed-local-media-path", "--compilation-config",
                     "-O", "--props"),
                    "it names a path the engine reads, writes or serves (or changes it at run time)"),
    **dict.fromkeys(("--trust-remote-code", "--middleware", "--tool-parser-plugin", "--hf-overrides"),
                    "it runs code the model or the caller brings"),
}
_NUMBER = re.compile(r"^-\d*\.?\d+(e[-+]?\d+)?$", re.IGNORECASE)


@dataclass(frozen=True)
class EnginePolicy:
    """What this agent starts beyond the tables: flags its operator allows (flag → how it takes a value),
    and where model files may be (``roots``: its model stores; None: anywhere, for engines built in code
    rather than by ``llmgw agent``)."""

    allowed: Mapping[str, str] = field(default_factory=dict)
    roots: tuple[Path, ...] | None = None

    @classmethod
    def of(cls, allowed: Iterable[str] = (), roots: Iterable[Path] | None = None) -> EnginePolicy:
        """From ``--allow-engine-arg`` values (``--flag``, or ``--flag=`` for one that always takes a value)
        and the stores; a value that is no flag is a ValueError naming it."""
        names: dict[str, str] = {}
        for raw in allowed:
            name, sep, rest = raw.partition("=")
            if not name.startswith("-") or name.strip("-") == "" or rest or len(name) > 100 \
                    or any(c.isspace() for c in name):
                raise ValueError(f"--allow-engine-arg {raw[:100]!r}: expected an engine flag, e.g. "
                                 "--allow-engine-arg=--log-file")
            names[name] = VALUE if sep else OPTIONAL
        return cls(allowed=names, roots=None if roots is None else tuple(Path(os.path.realpath(r)) for r in roots))


def _canonical(engine: str, name: str) -> str:
    allowed, short = TABLES[engine]
    if engine == "vllm" and name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")  # vLLM reads --max_model_len as --max-model-len
    return short.get(name, name)


def _refusal(engine: str, flag: str, name: str) -> str:
    why = _WHY.get(name) or _WHY.get(flag) or f"it is not among the {engine} arguments agents accept"
    return (f"engine argument {flag} is refused: {why}; an agent whose operator allows it accepts it "
            f"(`llmgw agent --allow-engine-arg={flag}`), docs/reliability.md, \"What cli may start\"")


def args_problem(engine: str, args: Iterable[str], policy: EnginePolicy | None = None) -> str | None:
    """Why ``args`` may not be given to ``engine`` (the first flag refused, named), or None."""
    policy = policy or EnginePolicy()
    if engine not in TABLES:
        return None
    table = TABLES[engine][0]
    items = list(args)
    i = 0
    while i < len(items):
        token = items[i]
        i += 1
        if not token.startswith("-") or _NUMBER.match(token):
            return (f"engine argument {token[:100]!r} is not a flag, nor the value of one: engines take no "
                    "positional arguments from a declaration")
        flag, eq, _ = token.partition("=")
        name = _canonical(engine, flag)
        arity = policy.allowed.get(flag) or policy.allowed.get(name) or table.get(name)
        if arity is None:
            return _refusal(engine, flag[:100], name)
        if eq or arity == FLAG:
            continue
        if i < len(items) and (not items[i].startswith("-") or _NUMBER.match(items[i])):
            i += 1  # its value
        elif arity == VALUE:
            return f"engine argument {flag} takes a value, and none follows it"
    return None


def _inside(path: Path, roots: Collection[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or r in real.parents for r in roots)


def read_paths(spec: m.ModelSpec, models_dir: Path | None = None) -> list[str]:
    """The local paths an engine reads ``spec``'s model from: llama.cpp's ``-m`` (``gguf_location``) and
    its adapters' files (``--lora``); a vLLM source that is no repository id."""
    from llmgw.engine.argv import gguf_location, is_repo_id

    if spec.engine == "vllm":
        return [] if is_repo_id(spec.source) else [spec.source]
    where = gguf_location(spec, models_dir)
    return [*(where[1:] if where[0] == "-m" else []), *(ref.path for ref in spec.adapters)]


def spec_problem(spec: m.ModelSpec, policy: EnginePolicy, *, models_dir: Path | None = None,
                 reads_files: bool = True) -> str | None:
    """Why an agent with ``policy`` refuses to start ``spec``, or None. ``reads_files``: False for a fake
    engine, which opens no model file (its arguments are checked all the same)."""
    if (why := args_problem(spec.engine, spec.engine_args, policy)) is not None:
        return why
    if policy.roots is None or not reads_files:
        return None
    for raw in read_paths(spec, models_dir):
        if not _inside(Path(raw).expanduser(), policy.roots):
            stores = ", ".join(map(str, policy.roots)) or "none"
            return (f"{raw[:300]} is outside this agent's model stores ({stores[:600]}): an engine reads model "
                    "files only from there; put the model in one (LLMGW_MODELS_DIR, the Hugging Face cache), or "
                    "start the agent with --allow-model-path DIR")
    return None
