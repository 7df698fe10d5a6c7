#!/usr/bin/env bash
# Installs mirror-mlx into ./.venv and fetches the default model.
#   ./install.sh          the runtime
#   ./install.sh --test   the runtime plus what the tests need (Core ML export, torch CPU, ...)
set -euo pipefail
cd "$(dirname "$0")"
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi

# Debian packages, installed when running as root with apt; otherwise a note says what to do.
apt_install() {
  local why=$1; shift
  if [[ ${EUID:-$(id -u)} -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
  else
    echo "note: $why (sudo apt-get install $*)" >&2
  fi
}

if [[ "$(uname -s)" == Linux ]]; then
  # MLX's bundled reference BLAS is ~30x slower than OpenBLAS for prefill; mirror-mlx uses
  # OpenBLAS automatically when it is installed.
  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' ||
    apt_install "for fast prefill install OpenBLAS" libopenblas0-pthread
  # The desktop chat test draws its window on a virtual X display.
  if [[ -n "$extras" ]] && ! command -v Xvfb >/dev/null; then
    apt_install "the desktop chat test needs Xvfb; it is skipped without" xvfb fonts-dejavu-core
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
.venv/bin/mirror-mlx download >/dev/null
