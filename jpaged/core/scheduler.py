"""Host-side scheduler: continuous batching over a paged KV cache.

The scheduler owns the waiting and running queues and the rows of the device page table
(Sequence.table_row); the KVCacheManager owns every sequence's pages and the page-table edits,
above the PageAllocator's free list. Each `schedule()` returns one frozen StepPlan of plain arrays
(jpaged/worker/step_plan.py); `commit()` takes the sampled tokens back.

Async scheduling: `dispatched(plan)` marks a plan's tokens computed as soon as the step is on
the device and gives each sampling row a placeholder (Sequence.num_placeholders) unless the
token certainly ends the sequence (max_tokens, max_model_len), so the next plan is made before
this one's tokens are known; its rows read those tokens on the device. `commit()` then turns
placeholders into tokens. A sequence that stops at commit has its row in the next plan (already
on the device) dropped there; that row writes only slots past the sequence's length into pages
freed at the stop, before any later step can write them (device order).

One rule drives everything (vLLM v1): each step gives every running sequence as many of its
uncomputed tokens as the token budget allows. A decode is one token; a prompt is many
(chunked when it exceeds the budget); a prefix-cache hit starts with num_computed_tokens > 0.

Memory: which pages hold a sequence's tokens (prefix hits, growth, sliding windows, paging
groups, copy-on-write, swap, caching full pages) is the KVCacheManager's
(jpaged/core/kv_cache_manager.py); the scheduler asks it for a sequence's pages by token
counts and never reads or writes a page id. When pages run out, the most recently admitted
running sequences are preempted (recomputed later, or swapped out by the manager).

Liveness: the oldest running sequence is never preempted (victims are the newest) and, since
the pool holds one sequence of max_model_len tokens (`sequence_pages` with groups; the engine
checks it at start; a request
that could never fit is refused by `unservable` before it is queued), it computes at least one
token every step and ends within max_model_len + 1 steps; with nothing running, the waiting
head is admitted in the same step. Admission has no head-of-line blocking: the waiting queue
is scanned in order and a sequence that does not fit this step (pages, rows, token budget) is
passed over, so smaller ones behind it are admitted. No starvation: a waiting sequence counts
the steps in which one behind it was admitted while it was not, over its whole life
(preemption keeps the count, and requeues it first in line); once it has been passed over
MAX_PASSED_STEPS steps, nothing behind it is admitted while it waits. From then on only
sequences ahead of it in line, or running, can run before it: a finite set (new arrivals
queue behind it, and a running sequence newer than it is preempted before it, so it queues
behind it too), each of which ends within max_model_len + 1 steps once it is the oldest.
With the KV host tier, a running sequence may once yield its pages to a waiting prompt that
is nearly all cached (jpaged/core/prompt_first.py): at most one such preemption each.
A sequence preempted by recompute is re-admitted, while others run, only when its whole
context fits beside their prompts' pages to come (KVCacheManager.can_allocate's reserved):
re-admitted chunk by chunk into a pool that cannot finish it, it was taken back again and
again. This only delays it behind running sequences, which end (above); with nothing
running it is admitted as any other.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from jpaged.config import EngineConfig
from jpaged.core import prompt_first
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.sequence import RequestGroup, SeqStatus, Sequence
from jpaged.sample.sampler import seeds_to_key_data
from jpaged.worker import step_plan
from jpaged.worker.step_inputs import Demand
from jpaged.worker.step_plan import ScheduledRow, StepPlan

# Steps a waiting sequence may be passed over (one behind it admitted while it is not)
# before nothing behind it is admitted while it waits (see the module docstring).
MAX_PASSED_STEPS = 16
# Waiting sequences that do not fit looked at per step before the scan stops (each look
# walks the sequence's prefix-cache pages; the queue may be long).
MAX_BLOCKED_PER_STEP = 32


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        eos_token_ids: tuple[int, ...] = (),
        *,
        swap_allocator: PageAllocator | None = None,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
        admits: Callable[[list[Demand]], bool] | None = None,
        loras=None,
        host_store=None,
    ) -> None:
        """admits: whether the running sequences and one more can step together (at Linux's
        mapping cap, the runner's: a compiled program holds them); None admits all.
        loras: a jpaged.lora.LoRAManager (LoRA on): a sequence on an adapter is admitted
        only with a device slot for it (LoRAManager.admit); None: no adapters.
        swap_allocator: host swap pages, required when preemption_mode is "swap".
        sliding_window: the window W every layer attends within, whose older pages are freed
        (module docstring); None keeps every page. group_windows: instead, one window (or
        None) per paging group of a model mixing attention kinds (models/kv_groups.py), each
        group a page table of its own."""
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        windows = (sliding_window,) if group_windows is None else tuple(group_windows)
        if not windows:
            raise ValueError("group_windows must name at least one group")
        for w in windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                name = "sliding_window" if group_windows is None else "group_windows"
                raise ValueError(f"{name} must be a positive integer, got {w!r}")
        self.windows = windows
        self.num_groups = len(windows)
        # The window every layer has (one group), else None.
        self.sliding_window = windows[0] if len(windows) == 1 else None
        self.config = config
        self.sched = config.scheduler
        self.page_size = config.cache.page_size
        self.allocator = allocator
        if self.sched.preemption_mode == "swap" and swap_allocator is None:
            raise ValueError('preemption_mode="swap" needs a swap_allocator (host swap pages)')
        self.swap_allocator = swap_allocator if self.sched.preemption_mode == "swap" else None
        self.kv = KVCacheManager(  # host_store: the prefix cache's host tier, or None
            config, allocator, windows, swap_allocator=self.swap_allocator, host_store=host_store
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_list = list(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        # Page-table rows; row max_num_seqs is a scratch row that padding writes go to. The
        # device table holds a block of max_num_seqs + 1 rows per group (KVCacheManager).
        self._free_rows = list(range(self.sched.max_num_seqs - 1, -1, -1))  # pop() -> 0 first
        self._reserved_rows: dict[int, list[int]] = {}  # parent seq_id -> rows for its forks
        self._next_seq_id = 0
        self._passed: dict[int, int] = {}  # seq_id -> steps it was passed over while waiting
        self.num_preemptions = 0
        self._admits = admits
        self.loras = loras

    @property
    def num_swaps_out(self) -> int:
        return self.kv.num_swaps_out

    @property
    def num_swaps_in(self) -> int:
        return self.kv.num_swaps_in

    @property
    def prefix_cache_query_tokens(self) -> int:
        return self.kv.prefix_cache_query_tokens

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.kv.prefix_cache_hit_tokens

    def reset_stats(self) -> None:
        self.num_preemptions = 0
        kv = self.kv
        kv.num_swaps_out = kv.num_swaps_in = 0
        kv.prefix_cache_query_tokens = kv.prefix_cache_hit_tokens = 0

    # -- requests --------------------------------------------------------------------------
    def add(self, group: RequestGroup, seed: int) -> None:
        seq = self._new_seq(group, 0, list(group.prompt_token_ids), seed)
        seq.needs_fork = group.params.n > 1
        group.seqs.append(seq)
        self.waiting.append(seq)
        self.kv.sessions.begin(group.request_id, group.session)

    def abort(self, group: RequestGroup) -> None:
        group.aborted = True
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.kv.drop_swap(seq)
        seq.status = SeqStatus.FINISHED
        self._seqs.pop(seq.seq_id, None)
        self._passed.pop(seq.seq_id, None)
        seq.num_placeholders = 0
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.group.finished:  # its session's idle time starts (session_pages.py)
            self.kv.sessions.end(seq.group.request_id)

    def unservable(self, num_prompt_tokens: int, n: int) -> str | None:
        """Why a request of num_prompt_tokens and n sequences could never be admitted, even
        with nothing else running, or None. Checked before it is queued: the engine refuses it."""
        s = self.sched
        if num_prompt_tokens >= s.max_model_len:
            return (
                f"prompt has {num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({s.max_model_len}) to leave room for one generated token"
            )
        if n > s.max_num_seqs:
            return f"n must be <= max_num_seqs ({s.max_num_seqs}), got {n}"
        if not s.enable_chunked_prefill and num_prompt_tokens > s.max_num_batched_tokens:
            return (
                f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"({s.max_num_batched_tokens}) and chunked prefill is off"
            )
        return self.kv.unservable(num_prompt_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequence(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence seq_id, or None."""
        return self._seqs.get(seq_id)

    def request_ids(self, plans: list[StepPlan]) -> set[str]:
        """The requests with an unfinished sequence in a row of plans."""
        seqs = (self._seqs.get(i) for plan in plans for i in plan.seq_ids.tolist())
        return {seq.group.request_id for seq in seqs if seq is not None}

    def request_ids_running(self) -> set[str]:
        return {seq.group.request_id for seq in self.running}

    def restart(self) -> None:
        """After a failed step, whose device state is made anew: every unfinished sequence is
        computed again from its tokens (running ones queued first in line, in admission
        order, their pages freed; swapped ones' host copies dropped), no placeholder or page
        edit is pending, and the prefix cache is empty."""
        for seq in reversed(self.running):
            self.kv.free(seq)
            self._release_rows(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        self.running = []
        for seq in self.waiting:
            self.kv.drop_swap(seq)
            seq.num_computed_tokens = seq.num_placeholders = 0
        self.kv.restart()

    def append_token(self, seq_id: int, token: int) -> None:
        """Appends a token chosen outside the sampler (beam search) to a sequence."""
        self._seqs[seq_id].token_ids.append(token)

    def running_sequence(self, seq_id: int) -> Sequence | None:
        """The running sequence seq_id, or None."""
        seq = self._seqs.get(seq_id)
        return seq if seq is not None and seq.status is SeqStatus.RUNNING else None

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self, proposals: dict[int, list[int]] | None = None) -> StepPlan:
        """The next step's plan.

        proposals: speculative tokens by seq_id for decoding sequences (the engine caps them
        at max_tokens and max_model_len); a row verifies them when the token budget and free
        pages allow, else it decodes one token (proposals never cause a preemption).
        """
        budget = self.sched.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        first, yielders = prompt_first.yielders(self, budget)
        for seq in yielders:  # they free the pages of a short, cached prompt, queued last
            seq.yielded = True
            self._preempt(seq, last=True)
        preempted = False
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_planned_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            self.kv.slide(seq)
            # A parent about to fork samples for its children too: it never speculates.
            extra = None
            if proposals and num_new == 1 and not seq.needs_fork:
                extra = proposals.get(seq.seq_id)
            if extra:
                extra = extra[: budget - 1]
                if extra and self.kv.allocate_slots(seq, 1 + len(extra)):
                    rows.append(self._row(seq, 1 + len(extra), len(rows), extra))
                    budget -= 1 + len(extra)
                    continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                rows.append(self._row(seq, num_new, len(rows)))
                budget -= num_new
        if first is not None and budget > 0 and (num_new := self._admit(first, budget)):
            rows.append(self._row(first, num_new, len(rows)))  # alone: the yielders wait
        elif not preempted:  # a step that preempted admits nothing (it would thrash)
            self._admit_waiting(rows, budget)
        for i in range(len(rows)):
            seq = rows[i].seq
            if seq.needs_fork and rows[i].keep_sample:
                rows.extend(self._fork(seq, i))
        edits = self.kv.take_edits(bool(rows))
        return step_plan.build(
            rows,
            page_size=self.page_size,
            eos_token_ids=self._eos_list,
            page_updates=edits.updates,
            page_copies=edits.copies,
            swap_out=edits.swap_out,
            swap_in=edits.swap_in,
            num_groups=self.num_groups,
            lora_loads=self.loras.take_loads() if self.loras is not None else (),
        )

    def _row(self, seq: Sequence, num_new: int, row: int, proposals=None) -> ScheduledRow:
        start = seq.num_computed_tokens
        keep = start + num_new - len(proposals or ()) == seq.num_planned_tokens
        return ScheduledRow(seq, num_new, start, row, keep, proposals)

    def _admit_waiting(self, rows: list[ScheduledRow], budget: int) -> None:
        """Admits waiting sequences in queue order while they fit, passing over those that
        do not, except one passed over MAX_PASSED_STEPS steps already: nothing behind it is
        admitted (see the module docstring)."""
        blocked: list[Sequence] = []  # passed over so far this step, in queue order
        num_passed = 0  # of them, those with an admission behind them
        for seq in list(self.waiting):
            if budget <= 0 or not self._free_rows or not self.kv.num_free_pages():
                break  # nothing more can be admitted this step
            num_new = self._admit(seq, budget)
            if num_new:
                rows.append(self._row(seq, num_new, len(rows)))
                budget -= num_new
                num_passed = len(blocked)
                continue
            if self._passed.get(seq.seq_id, 0) >= MAX_PASSED_STEPS:
                break  # its turn: nothing behind it goes first
            blocked.append(seq)
            if len(blocked) == MAX_BLOCKED_PER_STEP:
                break
        for seq in blocked[:num_passed]:
            self._passed[seq.seq_id] = self._passed.get(seq.seq_id, 0) + 1

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits a waiting sequence if slots, pages and budget allow; returns its new tokens
        (0: it stays waiting, nothing changed)."""
        slots_needed = seq.group.params.n if seq.needs_fork else 1
        if len(self.running) + slots_needed > self.sched.max_num_seqs:
            return 0
        if len(self._free_rows) < slots_needed:
            return 0
        if self._admits is not None and self.running:
            demands = [self._demand(q) for q in self.running] + [self._demand(seq)]
            if not self._admits(demands):
                return 0  # it waits for a batch a compiled program holds
        reserved = None  # a recomputed one waits to fit whole (can_allocate's reserved)
        if seq.recomputed and self.running:
            reserved = self.kv.pages_to_come(self.running)
        admission = self.kv.can_allocate(seq, budget, reserved)
        if admission is None or (self.loras is not None and not self.loras.admit(seq.group)):
            return 0  # (no adapter slot free: it waits)
        self.waiting.remove(seq)
        seq.table_row = self._free_rows.pop()
        if seq.needs_fork:
            self._reserved_rows[seq.seq_id] = [
                self._free_rows.pop() for _ in range(seq.group.params.n - 1)
            ]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.kv.allocate(seq, admission)
        return admission.num_new_tokens

    def _demand(self, seq: Sequence) -> Demand:
        """The most seq can ask of one step from now on (its rest of the prompt at once, the
        rows of its forks, its context up to max_tokens) for the admits check."""
        sched = self.sched
        end = seq.num_prompt_tokens + (seq.params.max_tokens or sched.max_model_len)
        return Demand(
            params=seq.params,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_new_tokens=max(seq.num_tokens - seq.num_computed_tokens, 1),
            context_len=min(max(end, seq.num_tokens), sched.max_model_len),
            num_rows=(seq.group.params.n if seq.needs_fork else 1)
            if seq.status is not SeqStatus.RUNNING
            else 1 + len(self._reserved_rows.get(seq.seq_id, ())),
            in_prompt=seq.num_output_tokens == 0,
            pooling=seq.group.pooler is not None,
        )

    def _fork(self, parent: Sequence, parent_row: int) -> list[ScheduledRow]:
        """Forks n - 1 children sharing every page of the parent; they sample from its row."""
        parent.needs_fork = False
        rows = []
        group = parent.group
        for index, table_row in enumerate(self._reserved_rows.pop(parent.seq_id), start=1):
            child = self._new_seq(
                group, index, list(parent.token_ids), seed=hash((parent.seed, index)) % 2**63
            )
            child.table_row = table_row
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = parent.num_tokens  # computed by the parent's step
            self.kv.fork(parent, child)
            group.seqs.append(child)
            self.running.append(child)
            rows.append(ScheduledRow(child, 0, child.num_computed_tokens, parent_row, True))
        return rows

    def _new_seq(self, group: RequestGroup, index: int, token_ids: list[int], seed: int):
        seq = Sequence(
            seq_id=self._next_seq_id,
            group=group,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(group.prompt_token_ids),
            seed=seed,
        )
        seq.sampling_constants = step_plan.sampling_constants(
            group.params, seeds_to_key_data([seed])[0]
        )
        self._seqs[seq.seq_id] = seq
        self._next_seq_id += 1
        return seq

    def _preempt(self, seq: Sequence, *, allow_swap: bool = True, last: bool = False) -> None:
        """Queues a running sequence first in line (last: at the back), its pages freed: swapped
        out first where KVCacheManager.preempt can, else it is recomputed from scratch."""
        self.running.remove(seq)
        if not self.kv.preempt(seq, allow_swap=allow_swap):
            seq.num_computed_tokens = 0
            seq.recomputed = True
        self._release_rows(seq)
        seq.status = SeqStatus.WAITING
        if last:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Frees a sequence's pages and its page-table row(s)."""
        self.kv.free(seq)
        self._release_rows(seq)

    def _release_rows(self, seq: Sequence) -> None:
        self._free_rows.append(seq.table_row)
        self._free_rows.extend(self._reserved_rows.pop(seq.seq_id, []))
        seq.table_row = -1

    # -- results ---------------------------------------------------------------------------
    def dispatched(self, plan: StepPlan) -> None:
        """The plan's step is on the device: its tokens count as computed, and each sampling
        row that may continue holds a placeholder for its token (see the module docstring)."""
        max_len = self.sched.max_model_len
        ends = plan.context_lens.tolist()
        for seq_id, end, keep in zip(plan.seq_ids.tolist(), ends, plan.keep_sample.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            seq.num_computed_tokens = end
            if not keep:
                continue
            n = seq.num_placeholders + 1  # tokens in flight, this one included
            max_tokens = seq.params.max_tokens
            if (max_tokens is None or seq.num_output_tokens + n < max_tokens) and (
                seq.num_tokens + n < max_len
            ):
                seq.num_placeholders = n

    def commit(self, plan: StepPlan, out) -> list[Sequence]:
        """Applies a step's SamplerOutput (numpy, rows in plan order); returns the sequences
        that got new tokens. Rows of finished sequences are dropped; a sequence preempted
        after the step was dispatched still gets its token."""
        if out.num_accepted is not None:
            return self._commit_verified(plan, out)
        result = []
        tokens = out.tokens.tolist()
        logprobs = out.logprobs.tolist()
        ends = plan.context_lens.tolist()
        keep = plan.keep_sample.tolist()
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:  # finished (or aborted) since the plan was made
                continue
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed_tokens = max(seq.num_computed_tokens, ends[i])
                self.kv.cache_full_pages(seq, ends[i])  # only pages of real tokens
            if not keep[i]:
                continue
            if seq.num_placeholders:
                seq.num_placeholders -= 1
            token = tokens[i]
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprobs[i]
            n = seq.params.logprobs
            if n is not None:
                top = zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist())
                # Tokens a grammar forbids have -inf: not among the most likely.
                seq.logprobs.append({token: logprobs[i], **{t: x for t, x in top if x > -1e30}})
            result.append(seq)
            self._check_stop(seq, token)
        return result

    def _commit_verified(self, plan: StepPlan, out) -> list[Sequence]:
        """A speculative step's tokens: row i emits out.spec_tokens[i, :a + 1] (its a accepted
        proposals, then the target's token), checked for stops one by one. Only the verified
        positions count as computed: the pages past them (rejected proposals' K/V) go back to
        the pool, and prefix caching registers only verified pages.

            positions   start .. start + a - 1 | start + a | .. start + n - 1
            tokens      last, accepted         | new token | rejected (freed)
        """
        result = []
        accepted = out.num_accepted.tolist()
        tokens, logprobs = out.spec_tokens.tolist(), out.spec_logprobs.tolist()
        ends = plan.context_lens.tolist()
        keep = plan.keep_sample.tolist()
        proposed = plan.num_proposed.tolist() if plan.num_proposed is not None else [0] * len(plan)
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            a = accepted[i]
            if keep[i]:
                seq.num_placeholders = max(seq.num_placeholders - 1, 0)
                n = seq.params.logprobs
                for j in range(a + 1):
                    token = tokens[i][j]
                    seq.token_ids.append(token)
                    seq.cumulative_logprob += logprobs[i][j]
                    if n is not None:
                        top = zip(
                            out.top_ids[i, j, :n].tolist(), out.top_logprobs[i, j, :n].tolist()
                        )
                        entry = {t: x for t, x in top if x > -1e30}
                        seq.logprobs.append({token: logprobs[i][j], **entry})
                    self._check_stop(seq, token)
                    if seq.is_finished:
                        break
                result.append(seq)
            if seq.status is not SeqStatus.RUNNING:
                continue
            verified = ends[i] - proposed[i] + a  # the K/V of these positions is valid
            seq.num_computed_tokens = verified
            self.kv.commit_verified(seq, verified, proposed[i])
        return result

    def mark_computed(self, plan: StepPlan) -> list[Sequence]:
        """Commits a step's computed tokens but appends none of its samples: the caller picks
        each sequence's next token itself (beam search). Returns, in row order, the running
        sequence of each row whose sample is its next token, or None."""
        sampled: list[Sequence | None] = []
        for seq_id, end, keep in zip(
            plan.seq_ids.tolist(), plan.context_lens.tolist(), plan.keep_sample.tolist()
        ):
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                seq.num_computed_tokens = end
                self.kv.cache_full_pages(seq, end)
            sampled.append(
                seq if keep and seq is not None and seq.status is SeqStatus.RUNNING else None
            )
        return sampled

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages and queues it last, to be recomputed after the
        waiting ones (beam search makes room so for beams that must run before it). Never
        swaps: the beam's next tokens are chosen outside the scheduler."""
        self._preempt(seq, allow_swap=False, last=True)

    def fork(self, parent: Sequence) -> Sequence:
        """A new sequence of parent's group with parent's tokens (beam search's fork).

        A running parent's child takes a free page-table row and shares every page of the
        parent (a write into a shared partly filled page copies it first, in KVCacheManager.allocate_slots); with no
        free row, or a parent that is not running, the child waits and is recomputed (prefix
        hits).
        """
        group = parent.group
        child = self._new_seq(group, len(group.seqs), list(parent.token_ids), parent.seed)
        group.seqs.append(child)
        if parent.status is not SeqStatus.RUNNING or not self._free_rows:
            self.waiting.append(child)
            return child
        child.table_row = self._free_rows.pop()
        child.status = SeqStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.running.append(child)
        return child

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
                return
            if token in p.stop_token_ids:
                self.finish(seq, "stop", token)
                return
        if (
            p.max_tokens is not None
            and seq.num_output_tokens >= p.max_tokens
            or seq.num_tokens >= self.sched.max_model_len
        ):
            self.finish(seq, "length")
