#!/usr/bin/env bash
# Installs mirror-mlx into ./.venv and fetches the default model.
#   ./install.sh          the runtime
#   ./install.sh --test   the runtime plus what the tests need (Core ML export, torch CPU, ...)
set -euo pipefail
cd "$(dirname "$0")"
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi

# On Linux, MLX's bundled reference BLAS is ~30x slower than OpenBLAS for prefill;
# mirror-mlx uses OpenBLAS automatically when it is installed.
if [[ "$(uname -s)" == Linux ]] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  if [[ ${EUID:-$(id -u)} -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null; }
  else
    echo "note: for fast prefill install OpenBLAS (sudo apt-get install libopenblas0-pthread)" >&2
  fi
fi

# The desktop chat test draws its window on a virtual X display.
if [[ -n "$extras" && "$(uname -s)" == Linux ]] && ! command -v Xvfb >/dev/null; then
  if [[ ${EUID:-$(id -u)} -eq 0 ]] && command -v apt-get >/dev/null; then
    xvfb="xvfb fonts-dejavu-core"
    apt-get install -y -q --no-install-recommends $xvfb >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $xvfb >/dev/null; }
  else
    echo "note: the desktop chat test needs Xvfb (sudo apt-get install xvfb); skipped without" >&2
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
.venv/bin/mirror-mlx download >/dev/null
