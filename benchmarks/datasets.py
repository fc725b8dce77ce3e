"""The file datasets of `minillm bench serving`, sampled as vLLM's `vllm bench serve` samples them.

--dataset-name sharegpt: a ShareGPT JSON file (a list of {"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}); entries with fewer than two turns are dropped, the rest shuffled
with --seed, and each gives its first turn as the prompt and the second turn's token count as the output
length (--sharegpt-output-len instead when given); a pair whose prompt or output is under 4 tokens, whose
prompt is over 1024 or whose sum is over 2048 is skipped (the output's floor is not checked with
--sharegpt-output-len), as vLLM's is_valid_sequence skips it.

--dataset-name custom: a JSONL file (.jsonl) of {"prompt": ...} lines, shuffled with --seed, each request
generating --custom-output-len tokens; on /v1/completions the prompt is rendered with the tokenizer's chat
template as a user message unless --skip-chat-template (on /v1/chat/completions the server renders it).

Fewer usable samples than --num-prompts are oversampled (drawn again at random, seeded with --seed), as
vLLM does, unless --no-oversample (then the run has fewer requests); none at all is a usage error.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

from minillm.benchmarks.cli_args import BenchUsageError

PROG = "minillm bench serving"
DATASET_NAMES = ("random", "sharegpt", "custom")

# vLLM's is_valid_sequence bounds (tokens).
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048

# Each dataset flag (its dest, as parsed) -> (the flag, the datasets that read it).
DATASET_FLAGS = {
    "dataset_path": ("--dataset-path", ("sharegpt", "custom")),
    "sharegpt_output_len": ("--sharegpt-output-len", ("sharegpt",)),
    "custom_output_len": ("--custom-output-len", ("custom",)),
    "skip_chat_template": ("--skip-chat-template", ("custom",)),
    "no_oversample": ("--no-oversample", ("sharegpt", "custom")),
    "disable_shuffle": ("--disable-shuffle", ("sharegpt", "custom")),
    "prompt": ("--prompt", ("random",)),
    "prompts_file": ("--prompts-file", ("random",)),
    "input_len": ("--random-input-len", ("random",)),
    "output_len": ("--random-output-len", ("random",)),
    "vocab_range": ("--vocab-range", ("random",)),
}


@dataclass(frozen=True)
class SampleRequest:
    """One request of a dataset: the prompt sent, its token count and the tokens it generates."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def add_dataset_options(p: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags of bench serve (--dataset-name itself is serving's)."""
    p.add_argument("--dataset-path", default=None,
                   help="The dataset file: ShareGPT's JSON (--dataset-name sharegpt) or a JSONL of "
                        '{"prompt": ...} lines (--dataset-name custom).')
    p.add_argument("--tokenizer", default=None,
                   help="The tokenizer that counts a dataset's tokens (default: --model, else the server's model).")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="ShareGPT: tokens each request generates (default: its answer's token count).")
    p.add_argument("--custom-output-len", type=int, default=256, help="Custom: tokens each request generates.")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="Custom: send each prompt as it is, without the tokenizer's chat template.")
    p.add_argument("--no-oversample", action="store_true",
                   help="Run fewer requests when the dataset has fewer usable samples than --num-prompts.")
    p.add_argument("--disable-shuffle", action="store_true", help="Take the dataset's samples in file order.")


def check_dataset_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error for a dataset flag that --dataset-name does not read, a file dataset without
    --dataset-path, or an output length below 1."""
    for dest, (flag, names) in DATASET_FLAGS.items():
        if args.dataset_name not in names and getattr(args, dest) != p.get_default(dest):
            p.error(f"{flag} is read by --dataset-name {' or '.join(names)}, not {args.dataset_name}")
    if args.dataset_name != "random" and args.dataset_path is None:
        p.error(f"--dataset-name {args.dataset_name} needs --dataset-path (the dataset file)")
    for flag, dest in (("--mixed-users", "mixed_users"), ("--offline-model", "offline_model")):
        if args.dataset_name != "random" and getattr(args, dest) is not None:
            p.error(f"{flag} runs random prompts only, not --dataset-name {args.dataset_name}")
    for dest in ("sharegpt_output_len", "custom_output_len"):
        value = getattr(args, dest)
        if value is not None and not 1 <= value <= 1 << 20:
            p.error(f"{DATASET_FLAGS[dest][0]} must be in [1, {1 << 20}], got {value}")


def usage_error(message: str) -> BenchUsageError:
    """A usage error of bench serving."""
    return BenchUsageError(PROG, message)


def read_text(path: str) -> str:
    """The dataset file's text; a usage error naming --dataset-path when it cannot be read."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise usage_error(f"--dataset-path {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:
        raise usage_error(f"--dataset-path: cannot read {path}: {exc.strerror or exc}") from None


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of each entry with at least two turns, in file order."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise usage_error(f"--dataset-path {path} is not JSON ({exc.msg} at line {exc.lineno}); "
                          f"--dataset-name sharegpt reads ShareGPT's JSON list of conversations") from None
    if not isinstance(data, list):
        raise usage_error(f"--dataset-path {path} holds a JSON {type(data).__name__}, not ShareGPT's list of "
                          f'{{"conversations": [...]}} entries')
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        pairs.append((_turn_text(turns[0], path, i, 0), _turn_text(turns[1], path, i, 1)))
    return pairs


def _turn_text(turn, path: str, entry: int, index: int) -> str:
    """A ShareGPT turn's "value"; a usage error naming the entry when it has none."""
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise usage_error(f'--dataset-path {path}: entry {entry}\'s conversations[{index}] has no "value" string')
    return turn["value"]


def read_custom(path: str) -> list[str]:
    """The "prompt" of each line of a JSONL file (blank lines skipped), in file order."""
    if not path.endswith(".jsonl"):
        raise usage_error(f"--dataset-path {path}: --dataset-name custom reads a JSONL file (.jsonl), as vLLM's does")
    prompts = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise usage_error(f"--dataset-path {path} line {number} is not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise usage_error(f'--dataset-path {path} line {number} has no "prompt" string')
        prompts.append(item["prompt"])
    return prompts


def shuffled(items: list, seed: int, disable: bool = False) -> list:
    """ITEMS in the order vLLM draws them: random.seed(seed); random.shuffle(items)."""
    items = list(items)
    if not disable:
        random.Random(seed).shuffle(items)
    return items


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's filter of a ShareGPT pair: neither too short nor too long."""
    too_short = prompt_len < MIN_LEN or (not skip_min_output_len_check and output_len < MIN_LEN)
    return not (too_short or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN)


def sample_sharegpt(pairs: list[tuple[str, str]], tokenizer, num_requests: int,
                    output_len: int | None = None) -> list[SampleRequest]:
    """The first NUM_REQUESTS valid pairs, each with its answer's token count (or OUTPUT_LEN)."""
    samples = []
    for prompt, completion in pairs:
        if len(samples) >= num_requests:
            break
        prompt_len = len(tokenizer(prompt).input_ids)
        new_output_len = len(tokenizer(completion).input_ids) if output_len is None else output_len
        if is_valid_sequence(prompt_len, new_output_len, skip_min_output_len_check=output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, new_output_len))
    return samples


def sample_custom(prompts: list[str], tokenizer, num_requests: int, output_len: int,
                  apply_template: bool) -> list[SampleRequest]:
    """The first NUM_REQUESTS prompts, rendered as a user message when APPLY_TEMPLATE."""
    samples = []
    for prompt in prompts[:num_requests]:
        if apply_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
        samples.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    return samples


def oversample(samples: list[SampleRequest], num_requests: int, seed: int) -> list[SampleRequest]:
    """SAMPLES grown to NUM_REQUESTS with draws from them, as vLLM's maybe_oversample_requests draws."""
    rng = random.Random(seed)
    return samples + [rng.choice(samples) for _ in range(num_requests - len(samples))]


def load_tokenizer(name: str, option: str):
    """The tokenizer of NAME (a directory or a hub id); a usage error naming OPTION when there is none."""
    return first_tokenizer([name], f"{option} {name}")


def first_tokenizer(names: list[str], source: str):
    """The tokenizer of the first of NAMES (directories or hub ids) that has one; a usage error naming
    SOURCE (where the names came from) and the first's failure when none has."""
    from minillm.model_store import resolve_tokenizer_path
    from minillm.tokenizer import Tokenizer
    first = None
    for name in names:
        try:
            return Tokenizer.from_pretrained(resolve_tokenizer_path(name))
        except (ValueError, OSError, RuntimeError) as exc:
            first = first or exc
    raise usage_error(f"{source}: no tokenizer to count the dataset's tokens with ({first})")


def sample_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """The requests of --dataset-name sharegpt or custom, oversampled to --num-prompts unless --no-oversample."""
    if args.dataset_name == "sharegpt":
        pairs = shuffled(read_sharegpt(args.dataset_path), args.seed, args.disable_shuffle)
        samples = sample_sharegpt(pairs, tokenizer, args.num_prompts, args.sharegpt_output_len)
    else:
        prompts = shuffled(read_custom(args.dataset_path), args.seed, args.disable_shuffle)
        apply_template = not args.skip_chat_template and args.endpoint != "/v1/chat/completions"
        if apply_template and not tokenizer.has_chat_template:
            raise usage_error(f"--dataset-name custom renders each prompt with the chat template, and the tokenizer "
                              f"{tokenizer.name} has none; pass --skip-chat-template to send the prompts as they are")
        samples = sample_custom(prompts, tokenizer, args.num_prompts, args.custom_output_len, apply_template)
    if not samples:
        raise usage_error(f"--dataset-path {args.dataset_path} has no usable sample for --dataset-name "
                          f"{args.dataset_name}{_filter_note(args)}")
    if len(samples) < args.num_prompts and args.no_oversample:
        print(f"{PROG}: --no-oversample: {len(samples)} of --num-prompts {args.num_prompts} requests "
              f"(the dataset's usable samples)", file=sys.stderr)
        return samples
    return oversample(samples, args.num_prompts, args.seed)


def _filter_note(args: argparse.Namespace) -> str:
    """Why ShareGPT pairs may all be dropped."""
    if args.dataset_name != "sharegpt":
        return ""
    return (f" (a pair counts when its prompt has {MIN_LEN} to {MAX_PROMPT_LEN} tokens, its answer at least "
            f"{MIN_LEN} and both at most {MAX_TOTAL_LEN})")
