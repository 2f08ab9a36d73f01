"""The gRPC front of jpaged: jpaged.v1.Generation over an engine step thread.

server.app builds and runs it, server.cli holds `jpaged serve` / `jpaged client`.
"""
