#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source the llama-cpp-python sdist vendors, once per
# machine, and print the binary's path on the last line.
#
#   bash scripts/llama-server.sh            # CPU build (what tests and GPU-less users run)
#   LLMGW_LLAMA_CUDA=1 bash scripts/llama-server.sh   # CUDA build, where nvcc is present
#   LLMGW_LLAMA_SDIST=llama_cpp_python-0.3.36.tar.gz bash scripts/llama-server.sh   # no download
#
# No registry ships a llama-server binary, and the sdist is the one source a package registry
# serves. The binary is cached outside the clone, keyed by the version and the build flags, so
# only the first run on a machine pays (~20 CPU-minutes). The web UI stays off: its default
# downloads prebuilt assets from the internet.
set -euo pipefail

version="${LLMGW_LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# The sdist's sha256 as the package index lists it: a build compiles only the source we pinned.
# Another version needs its own (LLMGW_LLAMA_SDIST_SHA256, from the index's #sha256= link).
declare -A pinned=([0.3.36]=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e)
sha256="${LLMGW_LLAMA_SDIST_SHA256:-${pinned[$version]:-}}"
flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
)
if [ "${LLMGW_LLAMA_CUDA:-0}" = 1 ]; then
  flags+=(-DGGML_CUDA=ON)
fi
flags_hash="$(printf '%s\n' "${flags[@]}" | sha256sum | cut -c1-12)"
cache="${LLMGW_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmgw}"
dest="$cache/llama-server-$version-$flags_hash"

if [ -x "$dest/llama-server" ]; then
  echo "$dest/llama-server"
  exit 0
fi

say() { echo "llama-server.sh: $*" >&2; }

# A compiler and CMake are all the build needs; installed like chromium where we may.
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]} with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}") >/dev/null
  else
    say "missing ${missing[*]}: install them (Debian/Ubuntu: apt-get install ${missing[*]}) and run again"
    exit 1
  fi
fi
python="${PYTHON:-python3}"

mkdir -p "$cache"
# One build at a time per machine: a second caller waits, then finds the binary.
exec 9>"$cache/.llama-server-$version-$flags_hash.lock"
flock 9
if [ -x "$dest/llama-server" ]; then
  echo "$dest/llama-server"
  exit 0
fi

work="$(mktemp -d "$cache/.build-XXXXXX")"
trap 'rm -rf "$work"' EXIT
say "building llama-server $version (llama-cpp-python sdist) in $work; once per machine, ~10-20 min on 2 cores"
sdist="${LLMGW_LLAMA_SDIST:-}"  # an sdist already here (an air-gapped machine): no download
if [ -z "$sdist" ]; then
  # pip prepares the sdist's metadata to name it, which fetches scikit-build-core; nothing is installed.
  "$python" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$version" >&2
  sdist="$work/llama_cpp_python-$version.tar.gz"
fi
if [ -z "$sha256" ]; then
  say "no sha256 pinned for llama-cpp-python $version: set LLMGW_LLAMA_SDIST_SHA256 (the index's #sha256= of the sdist)"
  exit 1
fi
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$got" != "$sha256" ]; then
  say "$sdist has sha256 $got, not the pinned $sha256: refusing to build it (a different or altered file)"
  exit 1
fi
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" "${flags[@]}" >&2
cmake --build "$work/build" --target llama-server --parallel "$(nproc)" >&2
mkdir -p "$dest.tmp"
cp "$work/build/bin/llama-server" "$dest.tmp/llama-server"
"$dest.tmp/llama-server" --version >&2 || true
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "$dest/llama-server"
