"""The KV host tier under tensor parallelism: each device's shard of a swap gather (its KV
heads) is written into its heads of the host page array (no gather of whole pages first),
replicated shards once; the host pages equal the gathered pages, float32 and int8 with
scales, at T = 8 and at T = 2 with two replicas per shard (sharded_worker.run_host_write).
Tokens with the tier at T = 2: test_tensor_parallel.py."""

from __future__ import annotations


def test_each_shard_writes_its_heads_of_the_host_pages(host_write_results):
    assert host_write_results == {
        "8x1": {"equal": True, "shards": 8},
        "2x2": {"equal": True, "shards": 4},
    }
