#!/usr/bin/env bash
# `strata serve` end to end (ctest serve_e2e): a real coordinator and two CPU worker processes on
# loopback with the default model, driven by Python's grpcio (tests/serve/test_serve.py).
# Usage: test_serve.sh BUILD_DIR SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 lacks grpc or protobuf, or protoc, openssl or
# pgrep is missing, or the default model has not been downloaded (scripts/setup.sh does).
set -euo pipefail

build=$1
src=$2
# shellcheck source=tests/python_env.sh
source "$src/tests/python_env.sh"
require_python grpc google.protobuf
require_tools protoc openssl pgrep
model=$("$build/strata" --help | sed -n 's/^default model: //p')
if [[ ! -r $model ]]; then
    echo "SKIP: the default model $model is missing (run scripts/setup.sh)"
    exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/stubs" "$tmp/work"
protoc --proto_path="$src/proto" --python_out="$tmp/stubs" "$src/proto/strata.proto"
"$py" "$src/tests/serve/test_serve.py" "$build" "$tmp/stubs" "$tmp/work"
