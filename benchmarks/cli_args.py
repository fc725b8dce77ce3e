"""Argument parsing for the benchmarks, in the look of the rest of the `minillm` command line.

Help reads as click's does (Usage:, Options:, <int> metavars, [default: X]); a bad argument is a
BenchUsageError and a failure the user can fix is a BenchError, both printed as one line.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import textwrap
from collections.abc import Callable

from minillm.argparse_utils import (
    AmbiguousOption, completed_option_words, dashed_option_words, parser_value_counts,
)

_METAVARS = {int: "<int>", float: "<float>", str: "<str>", None: "<str>"}


class BenchError(RuntimeError):
    """A benchmark cannot run as asked (no GPU, no server, ...): one line for the user."""


class BenchUsageError(Exception):
    """A bad command-line argument."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class _ClickLikeFormatter(argparse.HelpFormatter):
    """`Usage: PROG [OPTIONS]`, <type> metavars and `[default: X]` after each option's help."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=80)

    def add_usage(self, usage, actions, groups, prefix=None) -> None:
        positionals = "".join(f" {a.metavar or a.dest}" for a in actions if not a.option_strings)
        super().add_usage(f"{self._prog} [OPTIONS]{positionals}", actions, groups, prefix="Usage: ")

    def start_section(self, heading) -> None:
        super().start_section(heading.capitalize() if heading else heading)

    def _get_default_metavar_for_optional(self, action) -> str:
        return _METAVARS.get(action.type, "<str>")

    def _metavar_formatter(self, action, default_metavar):
        if action.choices is not None and action.metavar is None:
            choices = "<" + "|".join(map(str, action.choices)) + ">"
            return lambda size: (choices,) * size if isinstance(size, int) else choices
        return super()._metavar_formatter(action, default_metavar)

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is argparse.SUPPRESS or isinstance(default, bool)   # 1 == True: test by type
        shown = not hidden and action.nargs != 0
        if shown and "default" not in text:
            value = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text = f"{text}  [default: {value}]".strip()
        return text

    def _format_text(self, text: str) -> str:
        return textwrap.fill(" ".join(text.split()), width=78, initial_indent="  ", subsequent_indent="  ") + "\n\n"


class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise BenchUsageError instead of exiting. An unambiguous prefix of a
    long option is that option, as vLLM's bench parsers read it (completed before argparse, whose own
    abbreviation is off, so that an option's value that looks like a flag stays as written)."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description, formatter_class=_ClickLikeFormatter,
                         add_help=False, allow_abbrev=False)

    def parse_known_args(self, args=None, namespace=None):
        if "help" not in {a.dest for a in self._actions}:   # added last, so it is listed last
            self.add_argument("-h", "--help", action="help", help="Show this message and exit.")
        args = sys.argv[1:] if args is None else list(args)
        counts = parser_value_counts(self)
        args = dashed_option_words(args, counts, self._dashed)
        try:      # vLLM's bench parsers keep argparse's allow_abbrev: --num-prompt 8, --output-l 16
            args = completed_option_words(args, {o for o in counts if o.startswith("--")}, counts)
        except AmbiguousOption as exc:
            self.error(str(exc))
        parsed, rest = super().parse_known_args(args, namespace)
        self._refuse_empty_values(parsed)
        return parsed, rest

    def parse_args(self, args=None, namespace=None):
        """The options, as argparse parses them; an unknown one is a usage error naming the options
        close to it, as click's commands name them."""
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}{self._close_options(rest)}")
        return parsed

    def _dashed(self, arg: str) -> str:
        """ARG, a word where an option may stand, with the underscores of its option's name read as dashes
        (--num_seqs 4, --max_input_len=64), as vLLM's parser reads them, when that names an option (other
        text is left as it is)."""
        if not arg.startswith("--") or "_" not in arg.partition("=")[0]:
            return arg
        name, eq, value = arg.partition("=")
        dashed = name.replace("_", "-")
        return f"{dashed}{eq}{value}" if dashed in self._option_string_actions else arg

    def _close_options(self, unknown: list[str]) -> str:
        """' (possible options: ...)': the options whose names are close to the first unknown one's."""
        name = next((a.partition("=")[0] for a in unknown if a.startswith("--")), None)
        if name is None:
            return ""
        close = close_option_names(name, [o for o in self._option_string_actions if o.startswith("--")])
        return f" (possible options: {', '.join(sorted(close))})" if close else ""

    def _refuse_empty_values(self, parsed) -> None:
        """A usage error naming the first option given an empty text (an unset variable in `--model "$M"`):
        read on, it was the current directory (--model), or no file at all after the run (--json)."""
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if not action.option_strings or value is action.default:
                continue
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, str) and not v.strip() for v in values):
                self.error(f"{_long_option(action.option_strings)} is empty")

    def error(self, message: str):
        raise BenchUsageError(self.prog, message)


# How alike two option names must be (difflib's ratio of the names without their dashes) for one to be
# named for the other: at click's and argparse's 0.6, counted with the dashes, --bogus named --host.
CLOSE_OPTION_CUTOFF = 0.7


def close_option_names(name: str, options: list[str]) -> list[str]:
    """The options a mistyped NAME likely meant: those it abbreviates first (--max: --max-model-len,
    --max-num-seqs, where a prefix that begins one option alone is read as that option), then those spelled
    closest to it; three at most. Names are compared without their dashes, a long name with long options
    and a short one with short ones."""
    bare = {o: _bare_option(o) for o in sorted(options) if _is_long(o) == _is_long(name) and o != name}
    typed = _bare_option(name)
    abbreviated = [o for o, b in bare.items() if b.startswith(typed) and b != typed]
    close = difflib.get_close_matches(typed, list(dict.fromkeys(bare.values())), n=3, cutoff=CLOSE_OPTION_CUTOFF)
    spelled = [o for b in close for o, ob in bare.items() if ob == b]
    return list(dict.fromkeys([*abbreviated, *spelled]))[:3]


def _is_long(option: str) -> bool:
    return option.startswith("--")


def _bare_option(option: str) -> str:
    """OPTION's name as it is compared: no leading dashes, underscores read as dashes (--max_tokens)."""
    return option.lstrip("-").replace("_", "-")


def _long_option(option_strings: list[str]) -> str:
    return next((o for o in option_strings if o.startswith("--")), option_strings[0])


def run_main(main: Callable[[list[str]], int], prog: str, argv: list[str] | None = None) -> int:
    """Run a benchmark's main as a script: usage errors and BenchErrors become one line on stderr."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except BenchUsageError as exc:
        print(f"{exc.prog}: error: {exc.message} (try '{exc.prog} --help')", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def memory_bytes(text: str) -> int:
    """--kv-cache-memory-bytes's value as vLLM reads one ("4G", "512M", "1.5g", bytes), at least 1."""
    from minillm.config import parse_memory_bytes
    try:
        value = parse_memory_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte; got {text!r}")
    return value


def add_kv_cache_memory_option(p: BenchParser) -> None:
    """--kv-cache-memory-bytes: the KV pool's budget, as `minillm serve` takes it."""
    p.add_argument("--kv-cache-memory-bytes", type=memory_bytes, default=None,
                   help="Bytes of KV pool (4G, 512M, 1.5g or bytes; default: sized by the engine).")


def add_engine_model_options(p: BenchParser) -> None:
    """--model (default: random Qwen3-0.6B-shaped weights), --device, --gpu-memory-utilization and
    --kv-cache-memory-bytes."""
    p.add_argument("--model", help="Model directory (default: random weights in the Qwen3-0.6B shape, GPU only).")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="Backend.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="Share of the GPU's memory (GPU only).")
    add_kv_cache_memory_option(p)


def resolve_engine_device(args) -> None:
    """args.device -> "cuda" or "cpu"; the random default weights need a GPU (a BenchError without one)."""
    from minillm.engine import choose_backend

    backend = choose_backend(args.device)
    if backend == "numpy" and args.model is None:
        raise BenchError("no CUDA GPU here, and the default (random Qwen3-0.6B-shaped weights) needs one; on the "
                         "CPU give a small model, e.g. --model ../shared/models/stories260K --device cpu")
    args.device = "cuda" if backend == "cuda" else "cpu"


def check_seed_option(parser, seed) -> None:
    """parser.error naming --seed when SEED is no engine seed (vLLM's range, minillm.seeds)."""
    from minillm.seeds import check_engine_seed
    try:
        check_engine_seed(seed, "--seed")
    except ValueError as exc:
        parser.error(str(exc))


def check_sampling_option(parser, flag: str, **params) -> None:
    """parser.error naming FLAG when SamplingParams refuses PARAMS (its value checked as a request's is)."""
    from minillm.sampling_params import SamplingParams
    try:
        SamplingParams(**params)
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")


def resolve_model_files(args) -> None:
    """args.model (a hub id at --revision) and --tokenizer (or --tokenizer-revision's version of the model's
    tokenizer) as local directories, with their revisions spent, for LLM refuses a revision of a directory;
    a BenchError when one cannot be found."""
    from minillm.model_store import resolve_model_path, resolve_tokenizer_path
    name = args.model
    try:
        args.model = str(resolve_model_path(name, args.download_dir, args.revision))
        if args.tokenizer is not None or args.tokenizer_revision is not None:
            args.tokenizer = str(resolve_tokenizer_path(args.tokenizer or name, args.download_dir,
                                                        args.tokenizer_revision, args.revision))
    except (OSError, ValueError) as exc:
        from minillm.cli import engine_flag_words
        words = engine_flag_words(exc) if isinstance(exc, ValueError) else None
        raise BenchError(words or " ".join(str(exc).split())) from None
    args.revision = args.tokenizer_revision = None


def engine_model_options(args, model: str, **options) -> dict:
    """EngineConfig fields for args' model (random weights in bf16 when --model is not given) and device."""
    out = dict(model=model, device=args.device, **options)
    if args.model is None:
        out.update(dtype="bfloat16", load_format="dummy")
    if args.device == "cuda":
        out["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_memory_bytes is not None:
        out["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return out


# Bounds of the benchmarks' options, past which a run only allocates or waits for nothing: a
# workload's requests and token lengths are drawn before anything runs, and a long context is
# still far below 2**20 tokens.
MAX_REQUESTS = 65536              # 256 times nano-vllm's workload
MAX_TOKENS = 1 << 20              # tokens of one prompt, output, context or step
MAX_WORKLOAD_TOKENS = 1 << 25     # prompt tokens of a whole workload (128 times nano-vllm's)
MAX_SECONDS = 86400.0             # a timeout, a phase or a wait: a day


def check_bounds(prog: str, args, bounds: dict[str, tuple]) -> None:
    """A usage error naming the first option (dest: (lo, hi) or (lo, hi, unit); lo None for none)
    whose value, when given, lies outside its bounds (NaN too)."""
    for dest, (lo, hi, *unit) in bounds.items():
        value = getattr(args, dest)
        if value is None or ((lo is None or lo <= value) and value <= hi):
            continue
        option, unit_text = f"--{dest.replace('_', '-')}", "".join(f" {u}" for u in unit)
        allowed = f"at most {_bound(hi)}" if lo is None else f"in [{_bound(lo)}, {_bound(hi)}]"
        raise BenchUsageError(prog, f"{option} must be {allowed}{unit_text}, got {value}")


def check_workload_tokens(prog: str, count_option: str, count: int, length_option: str, length: int) -> None:
    """A usage error naming both options when COUNT prompts of up to LENGTH tokens are more than a
    workload may hold (the prompts are drawn up front, as lists of token ids)."""
    if count * length > MAX_WORKLOAD_TOKENS:
        raise BenchUsageError(prog, f"{count_option} {count} x {length_option} {length} = {count * length} "
                                    f"prompt tokens are past the {MAX_WORKLOAD_TOKENS} a workload may hold; "
                                    "lower one of them")


def _bound(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def require_positive(args, *names: str) -> None:
    """A BenchError naming the first of these integer options that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def check_output_file(path: str | None, option: str) -> None:
    """A BenchError naming the option when its output file could not be written, before the run
    it records (a bad path found after minutes of measuring loses them)."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BenchError(f"{option} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise BenchError(f"{option} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise BenchError(f"{option} {path} cannot be written (permission denied)")
