"""Prompt-first yielding with the KV host tier: a waiting turn whose prompt is nearly all
cached does not wait for another session's whole decode.

Why (issue 54, measured with a pool that holds one session's history): two sessions' turns
arrive together; the first is admitted and holds the pool until its last generated token,
so the second's TTFT is the first's whole turn (99 decode steps, 90% of it) although its
own prefill, its history loaded from the host tier, is one short step.

The rule (Scheduler.schedule asks `yielders` before it plans the running sequences): with
the host tier on, when the first waiting sequence is a fresh prompt (nothing generated or
computed, no prompt logprobs or pooling) whose pages do not fit in the free pages, and its
prompt tokens not cached on the device or in the host tier fit in one step's token budget,
the newest running sequences that have generated a token and never yielded are preempted
(queued last), just enough of them to free its pages. With swap preemption their K/V is
copied to host swap pages and back; with recompute their pages are freed cached, the pages
the prompt takes from them are copied to the host tier (its offloads), and their
resumption loads them back and computes only the last partial page. The prompt is then
admitted in that step, alone.

Bounds: a sequence yields at most once (Sequence.yielded), so the scheduler's liveness
and starvation arguments hold after finitely many yields; a yielder is never fresh, so it
never makes another sequence yield. Host code: O(running) per step, plus one sha256 per
prompt page when a fresh head does not fit and some sequence could yield.
"""

from __future__ import annotations

from jpaged.core.kv_cache_manager import sequence_pages
from jpaged.core.page_allocator import NULL_PAGE
from jpaged.core.sequence import SeqStatus, Sequence


def yielders(scheduler, budget: int) -> tuple[Sequence | None, list[Sequence]]:
    """(the waiting head to admit first, the running sequences that yield to it, newest
    first), or (None, []) when the rule does not apply (module docstring)."""
    kv = scheduler.kv
    if kv.host is None or not scheduler.waiting or not scheduler.running:
        return None, []
    head = scheduler.waiting[0]
    if (
        head.num_output_tokens or head.num_computed_tokens or head.swap_pages
        or head.needs_fork or head.group.pooler is not None
        or head.params.prompt_logprobs is not None
    ):  # fmt: skip
        return None, []
    candidates = [
        s for s in reversed(scheduler.running)
        if s.status is SeqStatus.RUNNING and s.num_output_tokens and not s.yielded
        and not s.needs_fork
    ]  # fmt: skip
    if not candidates:
        return None, []
    need = sequence_pages(kv.config, kv.windows, head.num_tokens) - kv.num_free_pages()
    if need <= 0:
        return None, []  # it fits as it is (or waits for rows, budget or an adapter)
    victims, freed = [], 0
    for seq in candidates:
        if freed >= need:
            break
        victims.append(seq)
        freed += private_pages(kv, seq)
    if freed < need or head.num_tokens - cached_prompt_tokens(kv, head) > budget:
        return None, []
    return head, victims


def private_pages(kv, seq: Sequence) -> int:
    """The pages a preemption of seq frees (those no other sequence holds)."""
    return sum(
        1 for t in seq.tables for p in t if p != NULL_PAGE and kv.allocator.ref_counts[p] == 1
    )


def cached_prompt_tokens(kv, seq: Sequence) -> int:
    """The tokens of seq's leading full pages cached on the device, then in the host tier
    (its first paging group's: an estimate of its hit, which changes nothing)."""
    host, ps, salt = kv.host, kv.page_size, seq.group.cache_salt
    parent_hash, parent_page, num_pages = None, None, 0
    for i in range((seq.num_tokens - 1) // ps):
        tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
        h = host.page_hash(parent_hash, tokens, salt)
        page = None
        if parent_page is not None or i == 0:  # device hits come first, each after the last
            page = kv.allocator.lookup(h, tokens, parent=parent_page, salt=salt)
        if page is None and not host.holds(h, tokens, salt):
            break
        parent_hash, parent_page, num_pages = h, page, num_pages + 1
    return num_pages * ps
