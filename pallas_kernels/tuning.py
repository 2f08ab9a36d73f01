"""Block sizes for the paged attention kernels, chosen by shape in one place.

Every kernel asks this module for its blocking; no call site picks numbers by hand. The rules
are small and explicit so a benchmark run can revise them in one diff:

- KV block: enough whole pages per loop iteration to cover a target number of tokens (GPU:
  64-128 tokens, the tile Triton pipelines well and that fits shared memory with 2 stages;
  TPU: 256 tokens, to amortise DMA issue and loop overhead). Always a power of two, and
  never more pages than the page table has (rounded up to a power of two).
- Context splits (GPU decode only): enough programs to fill the SMs about twice; a split
  never gets less than one KV block.
- Query rows: the query-head group is padded to a power of two (GPU: >= 16, the smallest
  tensor-core dot; TPU: >= 8 sublanes); prefill query blocks take enough tokens to make
  about 64 (GPU) or 128 (TPU) rows.
"""

from __future__ import annotations

import dataclasses

# Streaming multiprocessors of the target GPU (H100/H200: 132). Only used to size splits.
GPU_NUM_SMS = 132


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBlocks:
    group_rows: int  # query rows per program (query-head group padded)
    pages_per_block: int  # pages loaded per loop iteration
    num_splits: int  # context splits per (sequence, KV head); 1 on TPU
    num_warps: int = 4  # GPU only
    num_stages: int = 2  # GPU only


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillBlocks:
    group_rows: int  # query heads per KV head, padded to a power of two
    block_q: int  # query tokens per program (rows = block_q * group_rows)
    pages_per_block: int
    num_warps: int = 4
    num_stages: int = 2


def _pages_for(target_tokens: int, page_size: int, pages_per_seq: int, min_tokens: int) -> int:
    """Pages per KV block: ~target_tokens, at most the table's width, at least min_tokens."""
    ppb = next_pow2(max(1, target_tokens // page_size))
    ppb = min(ppb, next_pow2(pages_per_seq))
    return max(ppb, next_pow2(cdiv(min_tokens, page_size)))


def _num_splits(programs: int, blocks_per_seq: int, num_sms: int) -> int:
    """Context splits that bring `programs` (sequences x KV heads) to about twice the SMs."""
    splits = cdiv(2 * num_sms, programs) if programs < 2 * num_sms else 1
    return max(1, min(next_pow2(splits), blocks_per_seq, 16))


def gpu_decode_blocks(
    *, batch: int, num_kv_heads: int, group: int, page_size: int, pages_per_seq: int,
    head_dim: int, itemsize: int, num_sms: int = GPU_NUM_SMS,
) -> DecodeBlocks:
    # 128 tokens of bf16 x 128 dims is 32 KiB per K or V tile; 2 stages x (K + V) = 128 KiB.
    target = 128 if head_dim * itemsize <= 256 else 64
    ppb = _pages_for(target, page_size, pages_per_seq, min_tokens=16)
    splits = _num_splits(batch * num_kv_heads, cdiv(pages_per_seq, ppb), num_sms)
    rows = max(16, next_pow2(group))
    return DecodeBlocks(group_rows=rows, pages_per_block=ppb, num_splits=splits,
                        num_warps=4 if rows <= 32 else 8, num_stages=2)


def mosaic_decode_blocks(
    *, batch: int, num_kv_heads: int, page_size: int, pages_per_seq: int,
    num_sms: int = GPU_NUM_SMS,
) -> DecodeBlocks:
    """Mosaic GPU decode (Hopper wgmma): blocks of 128 tokens (a page of 128 is one block),
    the query group padded to wgmma's 64 rows, splits as for the Triton kernel."""
    ppb = max(1, 128 // page_size)
    splits = _num_splits(batch * num_kv_heads, cdiv(pages_per_seq, ppb), num_sms)
    return DecodeBlocks(group_rows=64, pages_per_block=ppb, num_splits=splits, num_warps=4,
                        num_stages=2)


def tpu_decode_blocks(
    *, batch: int, num_kv_heads: int, group: int, page_size: int, pages_per_seq: int,
    head_dim: int, itemsize: int,
) -> DecodeBlocks:
    del batch, num_kv_heads, head_dim, itemsize
    ppb = _pages_for(256, page_size, pages_per_seq, min_tokens=8)
    return DecodeBlocks(group_rows=max(8, next_pow2(group)), pages_per_block=ppb, num_splits=1)


def gpu_prefill_blocks(
    *, num_tokens: int, group: int, page_size: int, pages_per_seq: int, head_dim: int,
    itemsize: int,
) -> PrefillBlocks:
    gp = next_pow2(group)
    block_q = max(1, 64 // gp)
    block_q = max(1, min(block_q, next_pow2(num_tokens)))
    if block_q * gp < 16:  # Triton dots need >= 16 rows
        block_q = cdiv(16, gp)
    target = 64 if head_dim * itemsize <= 256 else 32
    ppb = _pages_for(target, page_size, pages_per_seq, min_tokens=16)
    return PrefillBlocks(group_rows=gp, block_q=block_q, pages_per_block=ppb, num_warps=4)


def tpu_prefill_blocks(
    *, num_tokens: int, group: int, page_size: int, pages_per_seq: int, head_dim: int,
    itemsize: int,
) -> PrefillBlocks:
    del head_dim, itemsize
    gp = next_pow2(group)
    block_q = max(8, 128 // gp)
    block_q = min(block_q, max(8, next_pow2(num_tokens)))
    ppb = _pages_for(128, page_size, pages_per_seq, min_tokens=8)
    return PrefillBlocks(group_rows=gp, block_q=block_q, pages_per_block=ppb)
