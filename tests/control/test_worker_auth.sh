#!/usr/bin/env bash
# The worker's side of the control plane's secret proof (ctest control_auth), against a
# coordinator written in Python (tests/control/test_worker_auth.py) that computes the proofs with
# Python's hmac: an independent implementation of proto/control_auth.h's formula.
# Usage: test_worker_auth.sh STRATA_WORKER SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 lacks grpc or protobuf, or protoc is missing.
set -euo pipefail

worker=$1
src=$2
py=/usr/bin/python3

if [[ ! -x $py ]] || ! "$py" -c 'import grpc, google.protobuf' 2>/dev/null; then
    echo "SKIP: $py has no grpc or google.protobuf module"
    exit 77
fi
if ! command -v protoc >/dev/null; then
    echo "SKIP: protoc is not installed"
    exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/stubs"
protoc --proto_path="$src/proto" --python_out="$tmp/stubs" "$src/proto/strata_internal.proto"
"$py" "$src/tests/control/test_worker_auth.py" "$worker" "$tmp/stubs" "$tmp"
