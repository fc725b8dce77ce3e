"""SamplingMetadata: the sampler's per-row inputs for one step, uploaded in one packed copy.

The per-row parameters the sampling kernels read live in one device buffer of int32 words (the
float fields are float32 views of the same words), `cap` rows per field:

    static    [NUM_STATIC * cap]  temperature | top_k | top_p | min_p | repetition | presence |
                                  frequency | logprob rows        written when the batch changes
    uniforms  [cap]               one draw per non-greedy row     written every step that has one
    entries   [entry_cap]         penalty entries (rows | tokens | counts | in_prompt, N each),
                                  then bans: min_tokens' and bad words' (rows | tokens, M each),
                                  then logit_bias entries (rows | tokens | float32 biases, K each),
                                  then allowed_token_ids (rows | tokens, A each | masked rows, R)
                                                                  written every step that has them

Each step packs what changed into a pinned host slot and queues one host-to-device copy of the
words from the first changed section to the last, on the current stream; a step whose rows and
parameters are those of the last upload, all greedy, with no penalty and no ban, copies nothing.
A row is known by its Sequence object and its SamplingParams object: a request's parameters are
validated when it is added and are not changed afterwards (vLLM's InputBatch reads them once, too).

The device buffer is single: every upload and every kernel that reads it run on one stream in
order, so an upload queued for step t+1 runs after step t's kernels. The host side is two pinned
slots used in turn, each waiting (normally not at all) for the copy that last read it: with one
step in flight, the copy of step t may not have run yet when the host packs step t+1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.allowed_tokens import allowed_entries, min_tokens_bans
from minillm.bad_words import bad_word_entries

STATIC_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprob_rows")
NUM_STATIC = len(STATIC_FIELDS)
_INT_FIELDS = {"top_k", "logprob_rows"}
MIN_ENTRY_WORDS = 16384
# The largest float32 below 1: the uniforms the kernels read stay in [0, 1) (sampler_uniforms).
_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))


@dataclass
class SamplingMetadata:
    """One step's sampling inputs as device views of the packed buffer (valid until the next step)."""

    temperature: object              # [B] float32
    top_k: object                    # [B] int32 (0: off)
    top_p: object                    # [B] float32
    min_p: object                    # [B] float32
    repetition_penalty: object       # [B] float32
    presence_penalty: object         # [B] float32
    frequency_penalty: object        # [B] float32
    uniforms: object                 # [B] float32 (0 for greedy rows)
    logprob_rows: list[int]          # batch rows that asked for log-probabilities
    logprob_rows_device: object      # [len(logprob_rows)] int32
    penalty_entries: tuple | None    # (rows, token_ids, output_counts, in_prompt): [N] int32 each
    banned: tuple | None             # (rows, token_ids): [M] int32, logits set to -inf
    copied: tuple[int, int] | None   # words [start, end) uploaded this step; None: no upload
    logit_bias: tuple | None = None  # (rows, token_ids [K] int32, biases [K] float32), added to the logits
    allowed: tuple | None = None     # (rows, token_ids): [A] int32, masked rows: [R] int32; the rest get -inf


def sampler_temperature(params) -> float:
    """The temperature the sampling kernels read: 0 (the argmax) for every greedy request (the greedy
    row draws no uniform)."""
    return 0.0 if params.is_greedy else params.temperature


def sampler_uniforms(draws) -> np.ndarray:
    """A generator's draws in [0, 1) as the float32 uniforms the sampling kernels read, still below 1:
    rounded to float32, a draw past 1 - 2**-25 (one in 33 million) became 1.0, whose share of the kept
    weight is all of it, and the pick fell past the last kept token to the argmax."""
    return np.minimum(np.asarray(draws, dtype=np.float32), _BELOW_ONE)


def sampler_top_k(params, vocab: int) -> int:
    """The top_k the sampling kernels read: 0 (off) for -1 and 0, and for any top_k that keeps the
    whole vocabulary (vLLM takes any top_k >= 1; the kernels read an int32 below the vocabulary)."""
    return params.top_k if 0 < params.top_k < vocab else 0


def row_values(params, vocab: int) -> tuple:
    """The static words of one row, in STATIC_FIELDS order (less logprob_rows)."""
    return (sampler_temperature(params), sampler_top_k(params, vocab), params.top_p, params.min_p,
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty)


def penalty_entries(seqs, rows) -> tuple[list[int], list[int], list[int], list[int]]:
    """One entry per distinct (row, token) seen by the penalised rows: (rows, tokens, output
    counts, in prompt 0/1). seqs: one per row (a Sequence or a view with params,
    prompt_token_ids and output_counts)."""
    out_rows, tokens, counts, in_prompt = [], [], [], []
    for b in rows:
        s = seqs[b]
        prompt = set(s.prompt_token_ids) if s.params.repetition_penalty != 1.0 else set()
        for t in prompt | set(s.output_counts):
            out_rows.append(b)
            tokens.append(t)
            counts.append(s.output_counts.get(t, 0))
            in_prompt.append(1 if t in prompt else 0)
    return out_rows, tokens, counts, in_prompt


def banned_entries(seqs, rows, eos_token_ids, vocab: int) -> tuple[list[int], list[int]]:
    """Below min_tokens, EOS and stop tokens cannot be sampled: (rows, tokens) to set to -inf.
    EOS is banned under ignore_eos too (vLLM's min_tokens bans every EOS id: ignore_eos only keeps
    EOS from ending the output)."""
    out_rows, tokens = [], []
    for b in rows:
        s = seqs[b]
        if s.num_output_tokens - 1 < s.params.min_tokens:   # outputs before the one sampled now
            grammar = getattr(s, "structured_output", None)
            banned = min_tokens_bans(s.params, () if grammar is not None and grammar.empty_only else eos_token_ids)
            banned = [t for t in banned if 0 <= t < vocab]
            out_rows.extend([b] * len(banned))
            tokens.extend(banned)
    return out_rows, tokens


def bias_entries(seqs, rows) -> tuple[list[int], list[int], list[int]]:
    """logit_bias of the rows: (rows, tokens, biases as float32 bit patterns), one entry a token
    (each request's were packed when its parameters were validated)."""
    out_rows, tokens, bits = [], [], []
    for b in rows:
        ids, values = seqs[b].params._logit_bias_entries
        out_rows.extend([b] * len(ids))
        tokens.extend(ids)
        bits.extend(values)
    return out_rows, tokens, bits


def _grown(size: int, need: int) -> int:
    """size doubled until it holds need."""
    while size < need:
        size *= 2
    return size


class _Slot:
    """A pinned host copy of the packed buffer and the event after the copy that last read it."""

    def __init__(self, device, num_words: int):
        self.words = device.empty_pinned((num_words,), np.int32)
        self.floats = self.words.view(np.float32)
        self.event = None

    def wait(self) -> None:
        if self.event is not None and not self.event.done:
            self.event.synchronize()


class SamplingInputBuffer:
    """The packed per-row sampling inputs of the last step and the upload of the next."""

    def __init__(self, ops, device, capacity: int, eos_token_ids):
        self.ops, self.device = ops, device
        self.eos_token_ids = list(eos_token_ids)
        self.cap = self.entry_cap = 0
        self._initial = (max(1, capacity), MIN_ENTRY_WORDS)
        self._slots: list[_Slot] = []
        self._retired: list[_Slot] = []   # slots of a smaller buffer whose copies may not have run
        self._next = 0
        self._key_seqs: list = []
        self._key_params: list = []
        self._is_clean = False            # the device's static words are those of _key_seqs
        self.num_uploads = 0

    # ---- layout --------------------------------------------------------------------------------
    @property
    def uniforms_offset(self) -> int:
        """First word of the uniforms section."""
        return NUM_STATIC * self.cap

    @property
    def entries_offset(self) -> int:
        """First word of the entries section."""
        return (NUM_STATIC + 1) * self.cap

    def _allocate(self, cap: int, entry_cap: int) -> None:
        """(Re)allocate the device buffer and the two host slots; the static words are lost."""
        self._retired = [s for s in self._retired + self._slots if s.event is not None and not s.event.done]
        self.cap, self.entry_cap = cap, entry_cap
        num_words = (NUM_STATIC + 1) * cap + entry_cap
        self._slots = [_Slot(self.device, num_words), _Slot(self.device, num_words)]
        self.words = self.ops.xp.zeros(num_words, dtype=np.int32)     # [num_words] on the device
        self.floats = self.words.view(np.float32)
        self._views: dict[int, dict] = {}
        self._is_clean = False

    def _field_views(self, batch: int) -> dict:
        """Device views [batch] of the static fields and the uniforms (cached per batch size)."""
        views = self._views.get(batch)
        if views is None:
            views = {}
            for f, name in enumerate(STATIC_FIELDS[:-1]):
                src = self.words if name in _INT_FIELDS else self.floats
                views[name] = src[f * self.cap:f * self.cap + batch]
            u = self.uniforms_offset
            views["uniforms"] = self.floats[u:u + batch]
            self._views[batch] = views
        return views

    # ---- one step ------------------------------------------------------------------------------
    def is_unchanged(self, seqs, params) -> bool:
        """True when the device holds the static words of exactly these rows and parameters."""
        return self._is_clean and seqs == self._key_seqs and params == self._key_params

    def prepare(self, seqs, vocab: int) -> SamplingMetadata:
        """Pack and upload (at most one copy) the inputs of the rows seqs; returns their views.

        Draws one uniform from each non-greedy sequence's generator, in batch order.
        """
        batch = len(seqs)
        params = [s.params for s in seqs]
        unchanged = self.is_unchanged(seqs, params)
        if not unchanged:
            self._key_seqs, self._key_params = list(seqs), params
            self._sampled_rows = [b for b, p in enumerate(params) if not p.is_greedy]
            self._penalty_rows = [b for b, p in enumerate(params) if p.needs_output_counts]
            self._min_tokens_rows = [b for b, p in enumerate(params) if p.min_tokens > 0]
            self._logprob_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
            self._bias_rows = [b for b, p in enumerate(params) if p.logit_bias]
            self._allowed_rows = [b for b, p in enumerate(params) if p._allowed_entries is not None]
            self._bad_word_rows = [b for b, p in enumerate(params) if p._bad_word_ids]
        uniforms = [seqs[b].next_uniform() for b in self._sampled_rows]
        pen = penalty_entries(seqs, self._penalty_rows) if self._penalty_rows else ([], [], [], [])
        ban = banned_entries(seqs, self._min_tokens_rows, self.eos_token_ids, vocab) if self._min_tokens_rows \
            else ([], [])
        if self._bad_word_rows:
            ban = tuple(a + b for a, b in zip(ban, bad_word_entries(seqs, self._bad_word_rows)))
        bias = bias_entries(seqs, self._bias_rows) if self._bias_rows else ([], [], [])
        allowed = allowed_entries(seqs, self._allowed_rows) if self._allowed_rows else ([], [], [])
        counts = (len(pen[0]), len(ban[0]), len(bias[0]), len(allowed[0]), len(allowed[2]))
        num_entries = 4 * counts[0] + 2 * counts[1] + 3 * counts[2] + 2 * counts[3] + counts[4]
        if batch > self.cap or num_entries > self.entry_cap or not self._slots:
            self._allocate(_grown(max(self.cap, self._initial[0]), batch),
                           _grown(max(self.entry_cap, self._initial[1]), num_entries))
            unchanged = False
        copied = self._upload(batch, params, vocab, uniforms, pen + ban + bias + allowed, num_entries, unchanged)
        return self._metadata(batch, counts, copied)

    def _upload(self, batch: int, params, vocab: int, uniforms, entries, num_entries: int, unchanged: bool):
        """Pack the needed sections into the next host slot and queue one copy; returns its range."""
        start, end = None, None
        u, e = self.uniforms_offset, self.entries_offset
        if not unchanged:
            start, end = 0, u + batch                 # static words and the uniforms (zeros when greedy)
        elif self._sampled_rows:
            start, end = u, u + batch
        if num_entries:
            start, end = (e if start is None else start), e + num_entries
        if start is None:
            return None
        slot = self._slots[self._next]
        self._next = 1 - self._next
        slot.wait()
        if not unchanged:
            self._pack_static(slot, batch, params, vocab)
        if start <= u:
            slot.floats[u:u + batch] = 0.0
            if self._sampled_rows:
                slot.floats[u + np.asarray(self._sampled_rows)] = sampler_uniforms(uniforms)
        if num_entries:
            pos = e
            for section in entries:           # lists, or int32 arrays (allowed_token_ids: up to the vocabulary)
                slot.words[pos:pos + len(section)] = section
                pos += len(section)
        slot.event = self.device.copy_to_device_async(self.words[start:end], slot.words[start:end])
        self._retired = [s for s in self._retired if not s.event.done]
        self._is_clean = True
        self.num_uploads += 1
        return start, end

    def _pack_static(self, slot: _Slot, batch: int, params, vocab: int) -> None:
        """Write the static fields of the rows into the host slot."""
        cap = self.cap
        if batch:
            cols = np.array([row_values(p, vocab) for p in params], dtype=np.float64)   # [B, NUM_STATIC - 1]
            for f, name in enumerate(STATIC_FIELDS[:-1]):
                dst = slot.words if name in _INT_FIELDS else slot.floats
                dst[f * cap:f * cap + batch] = cols[:, f]
        lp = (NUM_STATIC - 1) * cap
        slot.words[lp:lp + len(self._logprob_rows)] = self._logprob_rows

    def _metadata(self, batch: int, counts: tuple[int, ...], copied) -> SamplingMetadata:
        """Views of the step's sections; counts: (penalty, ban, bias, allowed entries, masked rows)."""
        num_pen, num_ban, num_bias, num_allowed, num_masked = counts
        views = self._field_views(batch)
        e, w = self.entries_offset, self.words
        pen = tuple(w[e + i * num_pen:e + (i + 1) * num_pen] for i in range(4)) if num_pen else None
        b0 = e + 4 * num_pen
        ban = (w[b0:b0 + num_ban], w[b0 + num_ban:b0 + 2 * num_ban]) if num_ban else None
        k0 = b0 + 2 * num_ban
        bias = (w[k0:k0 + num_bias], w[k0 + num_bias:k0 + 2 * num_bias],
                self.floats[k0 + 2 * num_bias:k0 + 3 * num_bias]) if num_bias else None
        a0 = k0 + 3 * num_bias
        allowed = (w[a0:a0 + num_allowed], w[a0 + num_allowed:a0 + 2 * num_allowed],
                   w[a0 + 2 * num_allowed:a0 + 2 * num_allowed + num_masked]) if num_allowed else None
        lp = (NUM_STATIC - 1) * self.cap
        return SamplingMetadata(**views, logprob_rows=list(self._logprob_rows),
                                logprob_rows_device=w[lp:lp + len(self._logprob_rows)],
                                penalty_entries=pen, banned=ban, copied=copied, logit_bias=bias, allowed=allowed)
