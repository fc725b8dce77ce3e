"""Speculative decoding (n-gram drafts): output tok/s and inter-token latency at batch 1, 8 and 64
with k = 2, 4, 6 against no speculation in the same run, on a workload whose outputs repeat their
inputs, with the measured acceptance rate beside each figure.

    python -m minillm.benchmarks.spec_decode                                   # random Qwen3-0.6B shape, bf16, GPU
    python -m minillm.benchmarks.spec_decode --model ../shared/models/stories260K --device cpu

Workloads: "own-output" (the default for random weights) builds each prompt from a random start and
the model's own greedy continuation of it, so the measured continuation goes on with whatever the
model repeats; "passage" (the default for a trained model) repeats a short story passage and asks to
continue it. Batch B keeps B requests running (a new one joins as one finishes) until enough
tokens are out; each figure is the fastest of --repeats measurements. ITL is each request's
(time its last token was read - time its first was read) / (tokens - 1), averaged over requests.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.benchmarks.workload import write_random_model_dir

PASSAGES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a big dog came to the park. The dog was happy and wanted to play with the ball.",
    "Tom had a red ball. He liked to throw the ball to his friend Sam. They played all day long.",
    "The sun was hot, so Mia went to the lake. She saw a little fish swim in the water.",
    "Ben and his mom went to the store. They wanted to buy milk and bread for the cat.",
    "The bird sat in the tree and sang a song. The children stopped to listen and smiled.",
    "Lucy found a shiny stone in the garden. She showed it to her dad, and he was proud of her.",
    "Max was a brave little boy. He helped his friend when she fell down and hurt her knee.",
]


@dataclass
class Figures:
    """One measurement: a batch size and k (0: no speculation)."""

    batch: int
    k: int
    output_tokens: int
    seconds: float
    itl_s: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None

    @property
    def tok_s(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm.benchmarks.spec_decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: random weights in the Qwen3-0.6B shape)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--workload", choices=["auto", "own-output", "passage"], default="auto")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--ks", default="2,4,6", help="num_speculative_tokens values (0, no speculation, always runs)")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--own-output-len", type=int, default=256,
                   help="own-output workload: greedy tokens of the model in each prompt")
    p.add_argument("--min-tokens", type=int, default=1024,
                   help="output tokens per measurement at least (and at least 2 x batch requests)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measure each (batch, k) this many times and keep the fastest (a busy host adds noise)")
    p.add_argument("--clock", choices=["wall", "process"], default="wall",
                   help="process: this process's CPU seconds (steadier on a shared CPU host; CPU backend only)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", help="write the figures to this file")
    return p.parse_args(argv)


def make_llm(args, model_dir: str, dummy: bool, max_num_seqs: int, max_model_len: int, k: int):
    """An LLM with speculation of k drafts (k = 0: none)."""
    from minillm import LLM
    spec = None
    if k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    return LLM(model_dir, device=args.device, dtype=dtype, load_format="dummy" if dummy else "auto",
               max_num_seqs=max_num_seqs, max_model_len=max_model_len, enforce_eager=args.enforce_eager,
               speculative_config=spec)


def passage_prompts(tokenizer, num: int) -> list[list[int]]:
    """num prompts: two story passages, both repeated, the second cut halfway (continue it)."""
    out = []
    for r in range(num):
        a, b = PASSAGES[r % len(PASSAGES)], PASSAGES[(r // len(PASSAGES) + r + 1) % len(PASSAGES)]
        text = f"{a} {b} {a} {b[:len(b) // 2]}"
        out.append(tokenizer.encode(text, add_special_tokens=True))
    return out


def own_output_prompts(llm, num: int, length: int, vocab: int) -> list[list[int]]:
    """num prompts: 16 random tokens and the model's greedy continuation of them (length tokens)."""
    from minillm import SamplingParams
    rng = np.random.default_rng(0)
    starts = [rng.integers(0, vocab, 16).tolist() for _ in range(num)]
    outs = llm.generate(starts, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True),
                        use_tqdm=False)
    return [s + list(o.outputs[0].token_ids) for s, o in zip(starts, outs)]


def measure(llm, prompts: list[list[int]], batch: int, k: int, args) -> Figures:
    """Keep `batch` requests running (a new one joins as one finishes) until at least min_tokens
    and two batches' worth of requests are out; tok/s over the whole run, on args.clock."""
    from minillm import SamplingParams
    clock = time.process_time if args.clock == "process" else time.perf_counter
    engine = llm.engine
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=0)
    num_requests = max(2 * batch, -(-args.min_tokens // args.output_len))
    before = engine.stats().spec_decode
    tokens, itls, added, first_token = 0, [], 0, {}
    started = clock()
    while added < num_requests or engine.has_unfinished_requests():
        while len(first_token) < batch and added < num_requests:
            # ids repeat across measurements: every request of the last one has been retired
            engine.add_request(f"r{added}", prompts[added % len(prompts)], params)
            first_token[f"r{added}"] = None
            added += 1
        outputs = engine.step()
        now = clock()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if first_token[out.request_id] is None and n:
                first_token[out.request_id] = now
            if out.finished:
                tokens += n
                if n > 1:
                    itls.append((now - first_token[out.request_id]) / (n - 1))
                del first_token[out.request_id]
    seconds = clock() - started
    rate = length = None
    after = engine.stats().spec_decode
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        rate = accepted / draft_tokens if draft_tokens else 0.0
        length = 1.0 + accepted / drafts if drafts else None
    return Figures(batch, k, tokens, seconds, float(np.mean(itls)), rate, length)


def run(args, model_dir: str, dummy: bool, vocab: int) -> tuple[list[Figures], list[list[int]], str]:
    """Every k (0 first, whose engine also builds own-output prompts) at every batch size."""
    from minillm import SamplingParams
    from minillm.loader import load_model_config
    from minillm.tokenizer import Tokenizer
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ks = [0] + [int(k) for k in args.ks.split(",") if int(k) > 0]
    workload = args.workload if args.workload != "auto" else ("own-output" if dummy else "passage")
    prompts = None
    if workload == "passage":
        prompts = passage_prompts(Tokenizer.from_pretrained(Path(model_dir)), max(batches))
    prompt_len = args.own_output_len + 16 if prompts is None else max(map(len, prompts))
    max_model_len = prompt_len + args.output_len + 8
    model_len = load_model_config(Path(model_dir)).max_position_embeddings
    if max_model_len > model_len:
        raise ValueError(f"prompts of {prompt_len} tokens and {args.output_len} output tokens exceed the "
                         f"model's {model_len} positions")
    figures = []
    for k in ks:
        llm = make_llm(args, model_dir, dummy, max(batches), max_model_len, k)
        try:
            if prompts is None:
                prompts = own_output_prompts(llm, max(batches), args.own_output_len, vocab)
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),   # warm-up
                         use_tqdm=False)
            for batch in batches:
                f = max((measure(llm, prompts, batch, k, args) for _ in range(args.repeats)), key=lambda f: f.tok_s)
                figures.append(f)
                print(f"  measured batch {batch:3d} k {k}: {f.tok_s:9.1f} tok/s", file=sys.stderr)
        finally:
            llm.shutdown()
    return figures, prompts, workload


def print_table(figures: list[Figures]) -> None:
    """One table: each k against k = 0 at the same batch size."""
    base = {f.batch: f for f in figures if f.k == 0}
    print(f"{'batch':>5}  {'k':>2}  {'output tok/s':>12}  {'vs no spec':>10}  {'ITL ms':>8}  "
          f"{'accept':>7}  {'mean len':>8}")
    for f in sorted(figures, key=lambda f: (f.batch, f.k)):
        k = "-" if f.k == 0 else str(f.k)
        speedup = f"{f.tok_s / base[f.batch].tok_s:.2f}x" if f.batch in base else "n/a"
        accept = "" if f.acceptance_rate is None else f"{f.acceptance_rate:.0%}"
        length = "" if f.mean_acceptance_length is None else f"{f.mean_acceptance_length:.2f}"
        print(f"{f.batch:>5}  {k:>2}  {f.tok_s:>12.1f}  {speedup:>10}  {f.itl_s * 1e3:>8.2f}  {accept:>7}  {length:>8}")


def main(argv: list[str] | None = None) -> int:
    """Run every (batch, k) and print one table beside the no-speculation figures."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_model_dir(Path(tmp) / "qwen3-0.6b-random"))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        figures, prompts, workload = run(args, model_dir, args.model is None, vocab)
    print(f"model: {args.model or 'random Qwen3-0.6B shape'} on {args.device}; workload {workload}: "
          f"{len(prompts)} prompts of {np.mean([len(p) for p in prompts]):.0f} tokens on average, "
          f"{args.output_len} output tokens each, temperature {args.temperature}; n-gram "
          f"{args.prompt_lookup_min}..{args.prompt_lookup_max}; {args.clock} clock, best of {args.repeats}")
    print_table(figures)
    if args.json:
        Path(args.json).write_text(json.dumps([{**f.__dict__, "tok_s": f.tok_s} for f in figures], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
