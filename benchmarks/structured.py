"""Structured outputs: the CPU time to fill bitmask rows for JSON-schema matchers, per step.

    python -m minillm.benchmarks.structured [--steps 200] [--rows 64] [--model DIR] [--json out.json]

Two tokenizers: stories260K's (512 tokens, sentencepiece with byte fallback) and a synthetic
byte-level BPE built here with Qwen3-0.6B's sizes (151,646 tokens under a 151,936-row LM head):
the 256 bytes, every pair of printable ASCII characters, JSON punctuation runs, numbers and
deterministic random words with and without a leading space, so it can spell any JSON. For each:
llguidance's tokenizer build and the schema's compile (one-off costs, off the step loop), then

  one row: a matcher walks random constrained paths (each step it fills its row, then accepts a
           random allowed token, a structural one a third of the time so that documents end;
           each finished document must parse as JSON); the CPU time of every fill after a new
           token is one sample. The first walk builds lexer states later matchers of the same
           grammar reuse: it is reported apart (cold), the second walk is the steady figure;
  a batch: --rows matchers at different places in the schema, advanced by one token between
           fills, filled into one bitmask by StructuredOutputManager.fill_bitmask (llguidance's
           thread pool), as the engine does each step: wall time.

Held against the step the fill must hide under: the forward pass of the Qwen3-0.6B decode step at
batch 256, 6.0 ms on the H200 (benchmarks/RESULTS.md, a different host: CPU figures here are
this machine's), and 10% of it, the cost the structured-outputs issue allows the whole feature.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.structured_output import StructuredOutputManager, StructuredOutputsParams, bitmask_words  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402

QWEN_HEAD_VOCAB = 151936
QWEN_TOKENIZER_VOCAB = 151646          # regular tokens + the special ones below
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORWARD_STEP_MS = 6.0                  # RESULTS.md: Qwen3-0.6B decode forward at batch 256, H200
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

# The shape: a nested object, an enum, bounded numbers, an array with min/maxItems, required
# strings. Strings bounded by maxLength cost far more to mask over a large vocabulary (llguidance
# checks each token's length against what is left), so the same schema runs with free strings too.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "angry", "calm"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "mood", "tags", "address", "score"],
    "additionalProperties": False,
}


def without_max_length(schema):
    """The schema with every maxLength dropped."""
    if isinstance(schema, dict):
        return {k: without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [without_max_length(v) for v in schema]
    return schema


SCHEMAS = {"maxLength strings": SCHEMA, "free strings": without_max_length(SCHEMA)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are spelled in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def synthetic_byte_level_tokenizer(num_regular: int = QWEN_TOKENIZER_VOCAB - len(SPECIALS), seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json string with num_regular tokens (no merges: ids only matter)."""
    rng = np.random.default_rng(seed)
    tokens: dict[bytes, None] = {bytes([b]): None for b in range(256)}
    printable = string.ascii_letters + string.digits + string.punctuation + " "
    for a in printable:
        for b in printable:
            tokens[(a + b).encode()] = None
    for piece in ['{"', '"}', '":', '",', '", "', '": "', '": ', '{\n', '\n}', '},', '],', '[]', '{}', '":[',
                  '":{', '"},', '"]', 'true', 'false', 'null', '\n  ', '\n    ', '  "', '    "']:
        tokens[piece.encode()] = None
    letters = np.array(list(string.ascii_lowercase))
    while len(tokens) < num_regular:
        n = 4096
        lengths = rng.integers(2, 11, n)
        kinds = rng.random(n)
        words = ["".join(w) for w in np.split(rng.choice(letters, int(lengths.sum())), np.cumsum(lengths)[:-1])]
        for word, kind, number in zip(words, kinds, rng.integers(0, 100000, n)):
            if kind < 0.45:
                word = " " + word
            elif kind < 0.55:
                word = word.capitalize()
            elif kind < 0.65:
                word = " " + word.capitalize()
            elif kind < 0.75:
                word = str(number)
            tokens[word.encode()] = None
            if len(tokens) == num_regular:
                break
    spell = bytes_to_unicode()
    vocab = {"".join(spell[b] for b in tok): i for i, tok in enumerate(tokens)}
    added = [{"id": num_regular + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}})


def allowed_ids(row: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


class Walker:
    """Picks a random allowed token; one time in three a structural one (a quote, bracket, comma or
    colon) when the mask allows any, so strings and numbers end and walks cover whole documents."""

    STRUCTURAL = b'"{}[],:'

    def __init__(self, ll_tokenizer, vocab: int, eos: set[int], seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.eos = np.array(sorted(eos))
        self.is_structural = np.zeros(vocab, bool)
        for i in range(ll_tokenizer.vocab_size):
            if any(c in self.STRUCTURAL for c in ll_tokenizer.decode_bytes([i])):
                self.is_structural[i] = True
        self.vocab = vocab

    def pick(self, row: np.ndarray) -> int:
        """A token from one bitmask row; EOS only when nothing else is allowed."""
        ids = allowed_ids(row, self.vocab)
        rest = ids[~np.isin(ids, self.eos)]
        if not len(rest):
            return int(ids[0])
        structural = rest[self.is_structural[rest]]
        if len(structural) and self.rng.random() < 1 / 3:
            return int(self.rng.choice(structural))
        return int(self.rng.choice(rest))


def walk_one_row(manager, compiled, walker: Walker, steps: int) -> tuple[list[float], int]:
    """CPU seconds of each fill right after a new token, over random constrained paths; and how
    many paths reached the end of the schema (each one checked to parse as JSON)."""
    vocab = manager.vocab_size
    row = np.zeros((1, bitmask_words(vocab)), np.int32)
    times, matcher, tokens, num_documents = [], compiled.new_matcher(), [], 0
    matcher.fill_bitmask(row, 0)
    while len(times) < steps:
        token = walker.pick(row[0])
        if not matcher.accept_token(token) or matcher.is_terminated():
            raise RuntimeError(f"the walk took a token the mask did not allow: {token}")
        tokens.append(token)
        if matcher.is_stopped():
            json.loads(manager.ll_tokenizer.decode_bytes(tokens))     # the vocabulary spells JSON
            num_documents += 1
            matcher, tokens = compiled.new_matcher(), []
        start = time.thread_time()         # this thread's CPU time: a busy host's preemptions stay out
        matcher.fill_bitmask(row, 0)
        times.append(time.thread_time() - start)
    return times, num_documents


def batch_fill(manager, compiled, walker: Walker, rows: int, steps: int) -> list[float]:
    """Seconds of each batch fill of `rows` matchers, each advanced by one token in between."""
    vocab = manager.vocab_size
    matchers = [compiled.new_matcher() for _ in range(rows)]
    for m in matchers:                          # spread them over the schema
        for _ in range(int(walker.rng.integers(0, 40))):
            one = np.zeros((1, bitmask_words(vocab)), np.int32)
            m.fill_bitmask(one, 0)
            if not m.accept_token(walker.pick(one[0])) or m.is_stopped():
                break
    times = []
    index = list(range(rows))
    for _ in range(steps):
        start = time.perf_counter()
        manager.fill_bitmask(matchers, index)
        times.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            if not m.accept_token(walker.pick(manager.bitmask[i])) or m.is_stopped():
                matchers[i] = compiled.new_matcher()
    return times


def measure(name: str, tokenizer_json: str, vocab: int, eos: list[int], schema_name: str, args) -> dict:
    manager = StructuredOutputManager(tokenizer_json, vocab, eos, max_num_seqs=args.rows)
    try:
        start = time.perf_counter()
        manager.ll_tokenizer
        tokenizer_s = time.perf_counter() - start
        compiled = manager.grammar_init(StructuredOutputsParams(json=SCHEMAS[schema_name])).result()
        # The first visits of a grammar's states build lexer states that later matchers reuse:
        # the first walk is the cold figure, the second the one a server sees after a few requests.
        walker = Walker(manager.ll_tokenizer, vocab, set(eos))
        cold, docs_cold = walk_one_row(manager, compiled, walker, args.steps)
        warm, docs_warm = walk_one_row(manager, compiled, walker, args.steps)
        batch = batch_fill(manager, compiled, walker, args.rows, max(10, args.steps // 4))
    finally:
        manager.shutdown()
    us = lambda xs, q: float(np.percentile(xs, q) * 1e6)     # noqa: E731
    return {"tokenizer": name, "schema": schema_name, "vocab": vocab, "tokenizer_build_s": tokenizer_s,
            "schema_compile_ms": compiled.compile_time_s * 1e3, "documents": docs_cold + docs_warm,
            "cold_row_fill_us_p50": us(cold, 50), "cold_row_fill_us_max": us(cold, 100),
            "row_fill_us_p50": us(warm, 50), "row_fill_us_p90": us(warm, 90), "row_fill_us_max": us(warm, 100),
            "row_fill_us_mean": statistics.fmean(warm) * 1e6,
            "rows": args.rows, "batch_fill_ms_p50": us(batch, 50) / 1e3, "batch_fill_ms_p90": us(batch, 90) / 1e3}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm.benchmarks.structured", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="single-row fills to time per tokenizer")
    p.add_argument("--rows", type=int, default=64, help="matchers in the batch fill")
    p.add_argument("--model", type=Path, default=STORIES, help="a model directory whose tokenizer to use")
    p.add_argument("--json", help="write the figures to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    if (args.model / "tokenizer.json").exists():
        tok = Tokenizer.from_pretrained(args.model)
        vocab = max(len(tok), json.loads((args.model / "config.json").read_text()).get("vocab_size", 0))
        for schema_name in SCHEMAS:
            results.append(measure(args.model.name, tok.backend.to_str(), vocab, tok.eos_token_ids, schema_name, args))
    else:
        print(f"# no tokenizer at {args.model}: skipping it", file=sys.stderr)
    start = time.perf_counter()
    synthetic = synthetic_byte_level_tokenizer()
    print(f"# synthetic byte-level tokenizer built in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for schema_name in SCHEMAS:
        results.append(measure("byte-level", synthetic, QWEN_HEAD_VOCAB, [QWEN_TOKENIZER_VOCAB - len(SPECIALS)],
                               schema_name, args))
    print(f"JSON-schema mask fill on this host ({os.cpu_count()} CPUs; one row: CPU time of the calling thread; "
          f"a batch: wall time, on llguidance's threads). Ceiling: the {FORWARD_STEP_MS:.1f} ms forward pass the fill hides under "
          f"(Qwen3-0.6B, batch 256, H200), and 10% of it ({FORWARD_STEP_MS * 100:.0f} us).")
    print(f"| tokenizer | vocab | schema | JSON documents walked | tokenizer build | schema compile | one row, first walk p50 / max (us) "
          f"| one row p50 / mean / p90 / max (us) | {args.rows} rows p50 / p90 (ms) | {args.rows} rows / forward |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['tokenizer']} | {r['vocab']:,} | {r['schema']} | {r['documents']} | {r['tokenizer_build_s']:.2f} s | {r['schema_compile_ms']:.1f} ms "
              f"| {r['cold_row_fill_us_p50']:.0f} / {r['cold_row_fill_us_max']:.0f} "
              f"| {r['row_fill_us_p50']:.0f} / {r['row_fill_us_mean']:.0f} / {r['row_fill_us_p90']:.0f} / "
              f"{r['row_fill_us_max']:.0f} | {r['batch_fill_ms_p50']:.2f} / {r['batch_fill_ms_p90']:.2f} "
              f"| {100 * r['batch_fill_ms_p50'] / FORWARD_STEP_MS:.0f} % |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
