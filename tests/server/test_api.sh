#!/usr/bin/env bash
# The public gRPC API server end to end (ctest server_api):
#   1. protoc generates strata_pb2.py from proto/strata.proto into a temporary folder;
#   2. test_api.py starts tests/server/api_testserver (the real server layer over a test
#      backend) in several configurations and drives it with Python's grpcio over loopback.
# Usage: test_api.sh API_TESTSERVER_BINARY SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 has no grpc or protobuf module, or protoc or
# openssl is missing. /usr/bin/python3 explicitly: the python3 first on PATH may be a pyenv
# without them.
set -euo pipefail

server=$1
src=$2
# shellcheck source=tests/python_env.sh
source "$src/tests/python_env.sh"
require_python grpc google.protobuf
require_tools protoc openssl

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/stubs" "$tmp/work"
protoc --proto_path="$src/proto" --python_out="$tmp/stubs" "$src/proto/strata.proto"
"$py" "$src/tests/server/test_api.py" "$server" "$tmp/stubs" "$tmp/work"
