#!/usr/bin/env bash
# The worker's side of the control plane's secret proof (ctest control_auth), against a
# coordinator written in Python (tests/control/test_worker_auth.py) that computes the proofs with
# Python's hmac: an independent implementation of proto/control_auth.h's formula.
# Usage: test_worker_auth.sh STRATA_WORKER SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 lacks grpc or protobuf, or protoc is missing.
set -euo pipefail

worker=$1
src=$2
# shellcheck source=tests/python_env.sh
source "$src/tests/python_env.sh"
require_python grpc google.protobuf
require_tools protoc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/stubs"
protoc --proto_path="$src/proto" --python_out="$tmp/stubs" "$src/proto/strata_internal.proto"
"$py" "$src/tests/control/test_worker_auth.py" "$worker" "$tmp/stubs" "$tmp"
