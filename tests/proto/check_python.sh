#!/usr/bin/env bash
# proto/ against Python's protobuf, both directions:
#   1. protoc generates Python modules from proto/*.proto into a temporary folder;
#   2. interop.py write: Python encodes the sample messages (py_*.bin);
#   3. test_proto (interop group): C decodes them through a grpc_byte_buffer, compares each with
#      the same message built in C, and writes its own encodings (c_*.bin);
#   4. interop.py check: Python decodes the C encodings and compares them with its messages.
# Usage: check_python.sh TEST_PROTO_BINARY SOURCE_DIR
# Exits 77 (ctest: skipped) when /usr/bin/python3 has no protobuf module or protoc is missing.
# /usr/bin/python3 explicitly: the python3 first on PATH may be a pyenv without protobuf.
set -euo pipefail

test_bin=$1
src=$2
# shellcheck source=tests/python_env.sh
source "$src/tests/python_env.sh"
require_python google.protobuf
require_tools protoc

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

protoc --proto_path="$src/proto" --python_out="$tmp" "$src/proto/strata.proto" "$src/proto/strata_internal.proto"
"$py" "$src/tests/proto/interop.py" write "$tmp"
STRATA_PROTO_INTEROP_DIR="$tmp" "$test_bin"
"$py" "$src/tests/proto/interop.py" check "$tmp"
echo "proto interop with Python protobuf $("$py" -c 'import google.protobuf as p; print(p.__version__)'): ok"
