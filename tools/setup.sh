#!/usr/bin/env bash
# The README's two commands. On Debian 12 (root, or a user with sudo):
#   tools/setup.sh demo   install what is missing, build, run the generator on its default model
#                         (models/kjv_tiny.bin); further arguments go to the generator
#   tools/setup.sh test   install what is missing, build, run every test
# Only packages that are not installed yet are installed; nothing else is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake make g++ libeigen3-dev libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev
          libcli11-dev pkg-config libcpp-httplib-dev nlohmann-json3-dev python3 curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

case "${1:-}" in
  demo)
    shift
    cmake --preset release >/dev/null
    cmake --build --preset release --target generate
    ./build/release/examples/generate "$@"
    ;;
  test)
    cmake --workflow --preset dev
    ;;
  *)
    echo "usage: tools/setup.sh demo [generate options] | test" >&2
    exit 2
    ;;
esac
