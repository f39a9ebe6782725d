#!/usr/bin/env bash
# `strata serve` end to end (ctest serve_e2e): a real coordinator and two CPU worker processes on
# loopback with the default model, driven by Python's grpcio (tests/serve/test_serve.py).
# Usage: test_serve.sh BUILD_DIR SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 lacks grpc or protobuf, or protoc, openssl or
# pgrep is missing, or the default model has not been downloaded (scripts/setup.sh does).
set -euo pipefail

build=$1
src=$2
py=/usr/bin/python3

if [[ ! -x $py ]] || ! "$py" -c 'import grpc, google.protobuf' 2>/dev/null; then
    echo "SKIP: $py has no grpc or google.protobuf module"
    exit 77
fi
for tool in protoc openssl pgrep; do
    if ! command -v "$tool" >/dev/null; then
        echo "SKIP: $tool is not installed"
        exit 77
    fi
done
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
