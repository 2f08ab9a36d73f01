"""The serving front of jpaged: gRPC (jpaged.v1.Generation) and the OpenAI-compatible HTTP API
over one engine step thread.

server.app builds and runs it, server.cli holds `jpaged serve` / `jpaged client`.
"""
