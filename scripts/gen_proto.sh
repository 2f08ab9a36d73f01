#!/usr/bin/env bash
# Regenerates the Python stubs of server/proto/jpaged/v1/generation.proto (committed).
# Run from anywhere; needs grpcio-tools. The proto is compiled with the repository root as
# include path, so the stubs import each other as server.proto.jpaged.v1.* and never clash
# with the jpaged package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. \
  --python_out=. --grpc_python_out=. \
  server/proto/jpaged/v1/generation.proto
