"""A fake ModelRunner with a host "model", for engine tests that must not compile a model.

FakeRunner has the interface LLMEngine and DraftModel use (dispatch / fetch / execute / swap /
run_prelude / precompile / warm_up_keys / reset_state / num_buckets, the programs' counters,
scratch_row, broadcast=None) and the real runner's memory model, in numpy:

    pool        int64[num_pages, page_size]: the token id each slot holds (-1: never written)
    page_table  int32[max_num_seqs + 1, max_pages_per_seq]: edited by the plans' updates
    swap space  int64[num_swap_pages + 1, page_size]: swap-outs before swap-ins, as the runner

Each step packs the plan exactly as the real runner does (step_key, the prelude for what does
not fit the step's share, step_inputs.pack, placeholders read from the previous step's
samples), writes every new token into its slot, and computes each row's next token from the
tokens it reads back through the page table, so a paging bug changes the output. The model
(FakeModel) is a function of the context:

    H[pos]   = sum over i <= pos of (token_i + 1) * w_i  (mod 2^31 - 1), fixed random w
    greedy   = perm[token_pos] when H[pos] % 4, else (H[pos] // 4) % vocab
    sampled  = a mix of the row's key, its generated-token count and H[pos]: the greedy token
               or another, so a seeded row's tokens are the same whatever shares its batch
    top 20   = greedy + 7 j (mod vocab), log-probabilities -(j + a fraction of H) (beam search)

Speculative verification accepts a proposal while it equals the token the row would have
made without it (greedy or seeded alike), so speculation changes no token. A draft model
(FakeModel(follows_context=False)) proposes perm[last token]: right about 3 times in 4.

It refuses what the real runner refuses or would silently get wrong: a plan outside every
bucket (step_key raises), a step key precompile would not list, page-table updates that
overflow or contradict each other within one scatter, copies that read a page written in the
same scatter, a token written to the null page, a context read past the key's page columns,
through the null page or from a slot never written. `max_steps` bounds the steps it runs: one
more raises StepBoundExceeded (the engine wraps it in EngineStepError), so a livelock ends a
test instead of hanging it. `gate` (a threading.Semaphore) makes each step wait for a permit,
for tests that step a server one step at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest

from jpaged.config import EngineConfig
from jpaged.core import engine as engine_module
from jpaged.core.engine import LLMEngine
from jpaged.core.page_allocator import NULL_PAGE
from jpaged.sample.sampler import MAX_LOGPROBS, SamplerOutput
from jpaged.spec_decode import draft_model as draft_module
from jpaged.worker.programs import PRELUDE_COPIES, PRELUDE_UPDATES
from jpaged.worker.runner import InFlightStep
from jpaged.worker.step_inputs import bucket_keys, pack, pad_rows, step_key, update_capacity
from jpaged.worker.step_inputs import warm_up_keys as _warm_up_keys
from models.config import ModelConfig

VOCAB = 40  # <s>, </s>, a-z, 0-9, space, "."
BOS, EOS = 0, 1
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ."
_MOD = 2**31 - 1
_MAX_POSITIONS = 4096


class StepBoundExceeded(AssertionError):
    """The runner was asked for more steps than max_steps: the engine did not finish."""


class FakeModel:
    """The host "model" (see the module docstring); stands in for params (a pytree leaf)."""

    dtype = np.dtype(np.float32)  # what LLMEngine reads off the params
    nbytes = 0  # resident weight bytes (quantization.weight_bytes): the fake holds no arrays

    def __init__(self, vocab_size: int = VOCAB, *, salt: int = 0, follows_context=True):
        rng = np.random.default_rng(salt)
        self.vocab_size = vocab_size
        self.perm = rng.permutation(vocab_size)
        self.weights = rng.integers(1, 2**20, _MAX_POSITIONS).astype(np.int64)
        self.follows_context = follows_context

    def prefix_hashes(self, tokens: np.ndarray) -> np.ndarray:
        """int64[n] H of every prefix of tokens (int64[n])."""
        return np.cumsum((tokens + 1) * self.weights[: len(tokens)]) % _MOD

    def greedy(self, last: int, h: int) -> int:
        if not self.follows_context or h % 4:
            return int(self.perm[last])
        return int((h >> 2) % self.vocab_size)

    def token(self, last: int, h: int, *, temperature: float, key, num_generated: int,
              banned=()) -> int:  # fmt: skip
        """The row's token after a context ending in `last` with hash h."""
        t = self.greedy(last, h)
        if temperature > 0:
            mix = _mix(int(key[0]), int(key[1]), num_generated, h if self.follows_context else 0)
            if (mix >> 8) & 1:
                t = mix % self.vocab_size
        while t in banned:
            t = (t + 1) % self.vocab_size
        return t

    def top(self, last: int, h: int) -> tuple[np.ndarray, np.ndarray]:
        """The 20 most likely ids (int32[20]) and their log-probabilities, descending."""
        g = self.greedy(last, h)
        j = np.arange(MAX_LOGPROBS)
        ids = (g + 7 * j) % self.vocab_size
        frac = ((h >> (j % 16)) & 7) / 16.0
        return ids.astype(np.int32), (-(j + frac)).astype(np.float32)


def _mix(*values: int) -> int:
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


class FakePrograms:
    """The compile counters the engine reads; a key counts as compiled when first run."""

    def __init__(self) -> None:
        self.keys: set = set()
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.warmed_up = False
        self.num_recompiles = 0
        # Where programs came from (jpaged.worker.programs.Programs): all "traced" here.
        self.trace_seconds = self.xla_seconds = self.load_seconds = 0.0
        self.num_xla_cache_hits = self.num_loaded = 0

    @property
    def num_traced(self) -> int:
        return self.num_compiles

    def summary(self) -> str:
        return f"{self.num_compiles} programs (fake)"

    def compile(self, key) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.num_compiles += 1
            if self.warmed_up:
                self.num_recompiles += 1

    @property
    def num_step_programs(self) -> int:
        return len(self.keys)

    @property
    def num_compiled(self) -> int:
        return len(self.keys)

    def step_keys(self) -> list:
        return sorted(self.keys, key=repr)


class FakeRunner:
    def __init__(self, config: EngineConfig, model_config, params: FakeModel, num_pages: int,
                 dtype, *, mesh=None, num_swap_pages: int = 0, broadcast=None,
                 cache_dir=None, kv_groups=None) -> None:  # fmt: skip
        assert mesh is None and broadcast is None, "the fake runs one device, one process"
        assert kv_groups is None, "the fake's models have one kind of attention"
        self.config = config
        self.model_config = model_config
        self.model = params
        self.num_pages = num_pages
        self.page_size = config.cache.page_size
        self.scratch_row = config.scheduler.max_num_seqs
        self.broadcast = None
        self.programs = FakePrograms()
        self.mask_words = -(-model_config.vocab_size // 32)
        self.num_swap_pages = num_swap_pages
        self.swap_space = None
        if num_swap_pages:
            # The real runner's page axis (3) of a (2, heads, slots, pages, page, dim) host
            # array, where the host page store reads and writes its pages.
            self.swap_space = np.full((1, 1, 1, num_swap_pages + 1, self.page_size), -1, np.int64)
        self._keys = {_plain(k) for k in bucket_keys(config)}
        self.num_steps = 0
        self.swap_seconds, self.num_swap_steps = 0.0, 0  # read by LLMEngine.stats (issue 54)
        self.max_steps: int | None = None
        self.gate: threading.Semaphore | None = None
        self.reset_state()

    def reset_state(self) -> None:
        rows, cols = self.config.scheduler.max_num_seqs + 1, self.config.max_pages_per_seq
        self.pool = np.full((self.num_pages, self.page_size), -1, np.int64)
        self.page_table = np.zeros((rows, cols), np.int32)
        self.last_tokens = np.zeros(self.config.scheduler.max_num_seqs, np.int32)

    # -- what the engine asks of a runner ----------------------------------------------------
    def num_buckets(self) -> int:
        return len(bucket_keys(self.config)) + 1 + (2 if self.swap_space is not None else 0)

    def refusal_at_cap(self, params, num_prompt_tokens: int = 0, *, pooling=False) -> None:
        return None  # no mapping cap: the fake compiles nothing

    def cap_refusal(self, needs) -> None:
        return None

    def admits(self, demands) -> bool:
        return True

    def warm_up_keys(self, context_len: int) -> list:
        return _warm_up_keys(self.config, context_len)

    def precompile(self, keys=None, context_len=None) -> float:
        for key in (
            bucket_keys(self.config, self.config.precompile_max_len) if keys is None else keys
        ):
            self.programs.compile(key)
        return 0.0

    def swap(self, plan) -> None:
        for dev, host in plan.swap_out.tolist():
            assert dev != NULL_PAGE and 0 < host <= self.num_swap_pages, (dev, host)
            self.swap_space[0, 0, 0, host] = self.pool[dev]
        for host, dev in plan.swap_in.tolist():
            assert dev != NULL_PAGE and 0 < host <= self.num_swap_pages, (host, dev)
            self.pool[dev] = self.swap_space[0, 0, 0, host]

    def execute(self, plan) -> SamplerOutput:
        return self.fetch(self.dispatch(plan))

    def fetch(self, step: InFlightStep) -> SamplerOutput:
        return step.out

    def run_prelude(self, updates: np.ndarray, copies: np.ndarray) -> None:
        self._edit(updates, copies)

    def dispatch(self, plan, prev_plan=None, token_bitmask=None, *, draft_probs=None,
                 draft_offset=None) -> InFlightStep:  # fmt: skip
        if self.gate is not None and not self.gate.acquire(timeout=60):
            raise StepBoundExceeded("no permit for a step in 60 s")
        self.num_steps += 1
        if self.max_steps is not None and self.num_steps > self.max_steps:
            raise StepBoundExceeded(f"more than {self.max_steps} steps")
        key = step_key(plan, self.config)
        if draft_offset is not None:
            key = dataclasses.replace(key, draft=True)
        assert _plain(key) in self._keys, f"{key} is no bucket precompile lists"
        self.programs.compile(key)
        cap = update_capacity(key, self.page_size)
        updates, copies = plan.page_updates, plan.page_copies
        while len(updates) > cap or len(copies) > key.num_seqs:  # as ModelRunner.dispatch
            upd = updates[:PRELUDE_UPDATES] if len(updates) > cap else updates[:0]
            cps = copies[:PRELUDE_COPIES] if len(copies) > key.num_seqs else copies[:0]
            updates, copies = updates[len(upd) :], copies[len(cps) :]
            self._edit(pad_rows(upd, PRELUDE_UPDATES, (self.scratch_row, 0, 0)),
                       pad_rows(cps, PRELUDE_COPIES, (0, 0)))  # fmt: skip
        plan = dataclasses.replace(plan, page_updates=updates, page_copies=copies)
        inputs = pack(plan, key, scratch_row=self.scratch_row, page_size=self.page_size,
                      mask_words=self.mask_words, prev_plan=prev_plan,
                      token_bitmask=token_bitmask)  # fmt: skip
        if key.spec_draft:
            assert draft_probs is not None and draft_probs.shape == (
                key.num_seqs,
                key.spec_k,
                self.model_config.vocab_size,
            )
        out = self._step(key, inputs, len(plan), draft_offset)
        return InFlightStep(key, plan, out)

    # -- the "device" -------------------------------------------------------------------------
    def _edit(self, updates: np.ndarray, copies: np.ndarray) -> None:
        """One scatter of page-table updates and one of page copies, as the jitted code
        does them: every copy reads before any writes; duplicate indices must agree."""
        seen: dict[tuple[int, int], int] = {}
        for row, col, page in updates.tolist():
            if (row, col) in seen:
                assert seen[(row, col)] == page, f"two updates of ({row}, {col}) in one scatter"
            seen[(row, col)] = page
        real = [(s, d) for s, d in copies.tolist() if (s, d) != (0, 0)]
        dst = [d for _, d in real]
        assert len(dst) == len(set(dst)), f"a page copied into twice in one scatter: {real}"
        # The scatter reads every source before writing any page, so each copy gets its
        # source's content from before the step. That is what the plan means unless a copy
        # reads a page that a copy listed before it writes (a chain: the planner expected
        # the new content). A page read and then written by a later copy (read by forks'
        # copies, freed, reused as another copy's destination) gets what the plan means.
        for i, (s, _) in enumerate(real):
            assert s not in dst[:i], f"a copy reads a page an earlier copy writes: {real}"
        assert NULL_PAGE not in dst, real
        if real:
            src, dst = np.asarray(real).T
            self.pool[dst] = self.pool[src]
        self.page_table[updates[:, 0], updates[:, 1]] = updates[:, 2]

    def _step(self, key, x, num_rows: int, draft_offset) -> SamplerOutput:
        self._edit(x.page_updates, x.page_copies)
        ps, model = self.page_size, self.model
        tokens = np.where(x.src_rows >= 0, self.last_tokens[np.maximum(x.src_rows, 0)],
                          x.token_ids).astype(np.int64)  # fmt: skip
        n = int(x.query_start[num_rows])
        assert np.all(np.diff(x.query_start) >= 0) and np.all(x.query_start[num_rows:] == n)
        slots = x.slot_mapping[0, :n]  # one paging group
        real_pages = slots // ps
        assert not np.any(real_pages == NULL_PAGE), "a token written to the null page"
        self.pool[slots // ps, slots % ps] = tokens[:n]
        self.pool[NULL_PAGE] = 0  # what padding tokens write there
        # Per row: its context's tokens read back through the page table, and their hashes.
        hashes, contexts = [], []
        for i in range(num_rows):
            q0, q1, ctx = int(x.query_start[i]), int(x.query_start[i + 1]), int(x.context_lens[i])
            assert q1 - q0 <= ctx and np.array_equal(
                x.positions[q0:q1], np.arange(ctx - q1 + q0, ctx)
            )
            assert -(-ctx // ps) <= key.num_page_cols, "context past the key's page columns"
            pos = np.arange(ctx)
            pages = self.page_table[x.table_rows[i], pos // ps]
            context = self.pool[pages, pos % ps]
            if model.follows_context:
                assert not np.any(pages == NULL_PAGE), f"row {i} reads the null page"
                assert not np.any(context < 0), f"row {i} reads a slot never written"
            contexts.append(context)
            hashes.append(model.prefix_hashes(np.maximum(context, 0)))
        s_pad = key.num_seqs
        s = x.sampling
        owner = np.searchsorted(x.query_start[1 : num_rows + 1], np.arange(n), side="right")

        def at(i: int, t: int, j: int):
            """Row i's token for the hidden state of step token t (j tokens after its first)."""
            r = int(owner[t])
            p = int(x.positions[t])
            last, h = int(contexts[r][p]), int(hashes[r][p])
            banned = [b for b in s.banned[i].tolist() if b >= 0]
            if key.spec_k and j >= int(s.num_banned_positions[i]):
                banned = []
            tok = model.token(last, h, temperature=float(s.temperature[i]), key=s.key_data[i],
                              num_generated=int(s.num_generated[i]) + j, banned=banned)  # fmt: skip
            ids, lps = model.top(last, h)
            lp = lps[ids == tok][0] if np.any(ids == tok) else np.float32(-30.0)
            return tok, lp, ids, lps

        out = {"tokens": np.zeros(s_pad, np.int32), "logprobs": np.zeros(s_pad, np.float32),
               "top_ids": None, "top_logprobs": None}  # fmt: skip
        if key.draft:
            probs = np.zeros((s_pad, self.model_config.vocab_size), np.float32)
            for i in range(num_rows):
                tok = at(i, int(x.logits_indices[i]), int(draft_offset))[0]
                out["tokens"][i] = tok
                probs[i, tok] = 1.0
            result = SamplerOutput(**out, draft_probs=probs)
        elif key.spec_k:
            k = key.spec_k
            spec = np.zeros((s_pad, k + 1), np.int32)
            spec_lp = np.zeros((s_pad, k + 1), np.float32)
            accepted = np.zeros(s_pad, np.int32)
            top = np.zeros((s_pad, k + 1, MAX_LOGPROBS), np.int32)
            top_lp = np.zeros((s_pad, k + 1, MAX_LOGPROBS), np.float32)
            for i in range(num_rows):
                num = int(x.num_proposed[i])
                a = None
                for j in range(k + 1):
                    spec[i, j], spec_lp[i, j], top[i, j], top_lp[i, j] = at(
                        i, int(x.logits_indices[i, j]), j
                    )
                    if a is None and (j >= num or x.proposals[i, j] != spec[i, j]):
                        a = j
                accepted[i] = a
                spec[i, :a] = x.proposals[i, :a]
            out.update(tokens=spec[:, 0].copy(), logprobs=spec_lp[:, 0].copy())
            if key.num_logprobs:
                out.update(top_ids=top, top_logprobs=top_lp)
            result = SamplerOutput(**out, num_accepted=accepted, spec_tokens=spec,
                                   spec_logprobs=spec_lp)  # fmt: skip
        else:
            top = np.zeros((s_pad, MAX_LOGPROBS), np.int32)
            top_lp = np.zeros((s_pad, MAX_LOGPROBS), np.float32)
            for i in range(num_rows):
                t = int(x.logits_indices[i])
                out["tokens"][i], out["logprobs"][i], top[i], top_lp[i] = at(i, t, 0)
            if key.num_logprobs:
                out.update(top_ids=top, top_logprobs=top_lp)
            result = SamplerOutput(**out)
        if key.prompt_logprobs:
            result = result._replace(**self._prompt_logprobs(x, n, owner, contexts, hashes))
        self.last_tokens = np.zeros_like(self.last_tokens)
        self.last_tokens[:s_pad] = result.tokens
        return result

    def _prompt_logprobs(self, x, n: int, owner, contexts, hashes) -> dict:
        t_pad = len(x.token_ids)
        lp = np.zeros(t_pad, np.float32)
        ids = np.zeros((t_pad, MAX_LOGPROBS), np.int32)
        lps = np.zeros((t_pad, MAX_LOGPROBS), np.float32)
        for t in range(n):
            r, p = int(owner[t]), int(x.positions[t])
            ids[t], lps[t] = self.model.top(int(contexts[r][p]), int(hashes[r][p]))
            target = int(x.prompt_targets[t])
            hit = ids[t] == target
            lp[t] = lps[t][hit][0] if target >= 0 and np.any(hit) else -30.0
        return {"prompt_logprobs": lp, "prompt_top_ids": ids, "prompt_top_logprobs": lps}


def _plain(key):
    """A step key without what bucket_keys leaves out (log-probabilities, penalties, bias)."""
    return dataclasses.replace(key, num_logprobs=0, penalty_shape=None, bias_width=0,
                               prompt_logprobs=False, draft=False)  # fmt: skip


# -- engines on the fake ---------------------------------------------------------------------
def char_tokenizer():
    """A tokenizers.Tokenizer of one character per token: <s> 0 and </s> 1 (special), then
    CHARS; text decodes by concatenation (stop strings are found in it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": BOS, "</s>": EOS, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


@dataclasses.dataclass
class FakeLoaded:
    """What LLMEngine reads of a LoadedModel."""

    config: ModelConfig
    params: FakeModel
    tokenizer: object
    eos_token_ids: tuple[int, ...] = (EOS,)
    mesh: None = None
    chat_template: str | None = None
    bos_token: str | None = "<s>"
    eos_token: str | None = "</s>"
    generation_defaults: dict = dataclasses.field(default_factory=dict)
    path: Path = Path("no-such-fake-model")  # not a directory: no sentence-transformers pooling


def fake_loaded(*, max_position_embeddings: int = 64, salt: int = 0, draft=False) -> FakeLoaded:
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
        max_position_embeddings=max_position_embeddings, eos_token_ids=(EOS,),
    )  # fmt: skip
    model = FakeModel(salt=salt, follows_context=not draft)
    return FakeLoaded(config, model, None if draft else char_tokenizer())


def fake_engine(config: EngineConfig, *, max_position_embeddings: int = 64) -> LLMEngine:
    """An LLMEngine of config on FakeRunners (the target's and, for a draft_model
    speculative config, the draft's: the same permutation, blind to the context)."""
    loaded = fake_loaded(max_position_embeddings=max_position_embeddings)
    config = dataclasses.replace(config, compilation_cache_dir=None)
    draft = fake_loaded(max_position_embeddings=max_position_embeddings, draft=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "ModelRunner", FakeRunner)
        mp.setattr(draft_module, "ModelRunner", FakeRunner)
        mp.setattr(engine_module, "load_draft", lambda config, dtype: draft)
        return LLMEngine(config, loaded=loaded)
