"""The `minillm` command line: chat, generate, serve, monitor, pull, list, bench."""
import sys

if __name__ == "__main__":      # python -m minillm.cli: started as the console script starts it
    from minillm.entry import main as _entry_main
    _entry_main()

import argparse
import contextlib
import dataclasses
import errno
import functools
import importlib
import inspect
import json
import os
import re
import signal
import typing
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from typer.core import TyperCommand

from minillm.argparse_utils import (
    AmbiguousOption, completed_option_words, dashed_option_word, option_name, option_positions,
)
from minillm.chat_terminal import is_terminal, terminal_safe
from minillm.config import MAX_BLAS_THREADS, EngineConfig
from minillm.model_store import expand_user

DEFAULT_CHAT_MODEL = "Qwen/Qwen3-0.6B"
STORE_DEFAULT = "default: the Hugging Face cache, $HF_HUB_CACHE or $HF_HOME/hub"
ENGINE_PANEL = "Engine options"
SAMPLING_PANEL = "Sampling options"
MODEL_DEFAULT = "Default: the model's generation_config.json value, else"
CHAT_MODEL_DEFAULT = "Default: the model's generation_config.json value (without --url), else"
STRUCTURE_PANEL = "Structured output (one of)"


def dashed_option_name(name: str) -> str:
    """An option's name as the commands declare it: underscores read as dashes (--max_model_len is
    --max-model-len), as vLLM's FlexibleArgumentParser reads a command line. Click applies it to the
    names of options (never to their values) and to both sides of a choice: only a name that is the
    command's option once dashed is changed, so choices keep their own spelling (llama3_json)."""
    dashed = name.replace("_", "-")
    if dashed == name:
        return name
    return dashed if dashed.lstrip("-") in _option_names() else name


@functools.cache
def _option_names() -> frozenset[str]:
    """The long option names (without their dashes) of every command, bench's included."""
    names, commands = set(), [typer.main.get_command(app)]
    while commands:
        command = commands.pop()
        commands += getattr(command, "commands", {}).values()
        for param in command.params:
            names.update(opt.lstrip("-") for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ()))
                         if opt.startswith("--"))
    return frozenset(names)


app = typer.Typer(name="minillm", help="minillm: a small LLM inference engine with a paged KV cache.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"],
                                    "token_normalize_func": dashed_option_name})
bench_app = typer.Typer(help="Benchmarks: offline throughput and latency, online serving, kernels.",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bench_app, name="bench")


def _print_version(value: bool) -> None:
    if value:
        from minillm import __version__
        require_stdout("--version")
        typer.echo(f"minillm {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[Optional[bool], typer.Option(
        "--version", "-v", callback=_print_version, is_eager=True,
        help="Print the version and exit (-v: vLLM's and Ollama's short name).")] = None,
) -> None:
    """minillm: a small LLM inference engine with a paged KV cache."""


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def _click_class(name: str) -> type:
    """typer's click exception class NAME (typer may vendor its own copy of click)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


UsageError = _click_class("UsageError")
ClickException = _click_class("ClickException")
NoSuchOption = sys.modules[UsageError.__module__].NoSuchOption


def _plain_metavar(names: str) -> str:
    """An option's names and metavar as help shows them, typer's type names made plain: a repeatable
    option's value is one value (<list[str]> -> <str>), and a range is in the text ([x>=1]), not the
    metavar (<int range> -> <int>)."""
    return re.sub(r"<list\[(\w+)\]>", r"<\1>", re.sub(r"<(int|float) range>", r"<\1>", names))


class MinillmCommand(TyperCommand):
    """A command whose help lists its options under their headings (Engine options, Sampling options, ...)
    and that names vLLM's short flags of two letters (-pp, -dp) as such, not as -p given twice."""

    def format_options(self, ctx, formatter) -> None:
        arguments, groups = [], {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            record = (_plain_metavar(record[0]), record[1])
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                groups.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for heading, records in (("Arguments", arguments), *groups.items()):
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        params = self.get_params(ctx)
        names = {o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        refused = {o for o in (*VLLM_FLAGS_NOT_TAKEN, *getattr(self, "refused_options", {})) if o.startswith("--")}
        try:      # vLLM's parsers take an unambiguous prefix of an option: --max-model 512, --temp 0
            args = completed_option_words(args, names | refused, option_value_counts(params))
        except AmbiguousOption as exc:
            raise UsageError(str(exc), ctx=ctx) from None
        return self.parse_words(ctx, args)

    def parse_words(self, ctx, args: list[str]) -> list[str]:
        """Parse ARGS, their abbreviated options completed; commands that rewrite words first extend this."""
        params = self.get_params(ctx)
        short = {o for p in params for o in (*p.opts, *p.secondary_opts) if not o.startswith("--")}
        counts = option_value_counts(params)
        for arg, at_option in zip(args, option_positions(args, counts)):
            refused = arg in VLLM_FLAGS_NOT_TAKEN or arg in getattr(self, "refused_options", {})
            if at_option and refused and not arg.startswith("--") and arg not in short and arg[:2] not in short:
                raise NoSuchOption(arg, f"No such option: {arg}", ctx=ctx)
        json_options = {o for p in params if getattr(p, "metavar", None) == "JSON" for o in p.opts}
        return super().parse_args(ctx, dotted_json_options(args, json_options, counts) if json_options else args)


def option_value_counts(params) -> dict[str, int]:
    """{option string: how many values it takes} for a click command's PARAMS (0 for a switch)."""
    return {o: 0 if p.is_flag or p.count else p.nargs for p in params if p.param_type_name == "option"
            for o in (*p.opts, *p.secondary_opts)}


def dotted_json_options(args: list[str], options: set[str], value_counts: dict[str, int] | None = None) -> list[str]:
    """vLLM's dotted form of a JSON option folded into the option: `--speculative-config.method ngram
    --speculative-config.num_speculative_tokens 3` (or `--x.key=value`; `--x.key+ v` appends to a list)
    is --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}', over the keys of a
    --speculative-config JSON given too. A value is read as JSON where it is JSON, else as a string. The
    option's name may be written with underscores (--speculative_config.method), as vLLM reads it; the
    keys after the dot keep their own spelling. Only a word where an option may stand is read so: the
    value of an option (VALUE_COUNTS: how many each of the command's options takes; OPTIONS take one) and
    every word after a bare "--" are kept as they are (-p --speculative-config.method is that prompt)."""
    at_option = option_positions(args, {**(value_counts or {}), **dict.fromkeys(options, 1)})
    args = [_dashed_json_option(arg, options) if at else arg for arg, at in zip(args, at_option)]
    dotted = {a.partition(".")[0] for a, at in zip(args, at_option)
              if at and a.partition(".")[0] in options and a.partition(".")[2]}
    if not dotted:
        return args
    out, objects, where = [], {}, {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not at_option[i]:         # a value, or a word after "--"
            out.append(arg)
            i += 1
            continue
        name, dot, path = arg.partition(".")
        whole, eq, text = arg.partition("=")
        if whole in dotted and (eq or i + 1 < len(args)):     # the whole JSON, merged with the dotted keys
            where.setdefault(whole, len(out))
            objects[whole] = {**_json_object_arg(text if eq else args[i + 1], whole), **objects.get(whole, {})}
            i += 1 if eq else 2
            continue
        if not dot or name not in dotted or not path:
            out.append(arg)
            i += 1
            continue
        path, eq, value = path.partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise UsageError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        where.setdefault(name, len(out))
        _set_dotted(objects.setdefault(name, {}), path, _json_or_text(value), arg)
        i += 1
    for name, at in sorted(where.items(), key=lambda item: -item[1]):
        out[at:at] = [name, json.dumps(objects[name])]
    return out


def _dashed_json_option(arg: str, options: set[str]) -> str:
    """ARG with the underscores of its name (up to a dot or "=") read as dashes where that names one of
    OPTIONS (--speculative_config.method=ngram is --speculative-config.method=ngram); else ARG as it is."""
    if not arg.startswith("--"):
        return arg
    dashed = dashed_option_word(arg)
    return dashed if dashed != arg and option_name(dashed) in options else arg


def _json_object_arg(value: str, option: str) -> dict:
    """The JSON object given whole to OPTION beside dotted keys (else the option's own check speaks)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise UsageError(f"{option} takes a JSON object when its keys are also given as {option}.KEY, got {value!r}")
    return parsed


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_dotted(target: dict, path: str, value, arg: str) -> None:
    """target[a][b]... = value for path "a.b..." ("a.b+" appends value to the list there)."""
    keys = path.split(".")
    append = keys[-1].endswith("+")
    keys[-1] = keys[-1].removesuffix("+")
    if not all(keys):
        raise UsageError(f"{arg}: an empty key")
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise UsageError(f"{arg}: {key} is already given a value that is not an object")
    if append:
        items = target.setdefault(keys[-1], [])
        if not isinstance(items, list):
            raise UsageError(f"{arg}: {keys[-1]} is already given a value that is not a list")
        items.append(value)
    else:
        target[keys[-1]] = value


# ---------------------------------------------------------------------------------------------
# Engine options: declared once, added to every command that loads a model
# ---------------------------------------------------------------------------------------------

def _default(name: str):
    """EngineConfig's own default, so the CLI never drifts from it."""
    return EngineConfig.__dataclass_fields__[name].default


def _engine_option(*decls: str, help: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=ENGINE_PANEL, **kw)


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"


class LoadFormat(str, Enum):
    auto = "auto"
    safetensors = "safetensors"     # vLLM's name for what auto reads
    dummy = "dummy"


class SchedulingPolicy(str, Enum):
    fcfs = "fcfs"
    priority = "priority"


class EngineCore(str, Enum):
    process = "process"
    thread = "thread"


class KVRole(str, Enum):
    producer = "producer"
    consumer = "consumer"
    both = "both"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    half = "half"
    float = "float"


# vLLM's other names for two dtypes (--dtype half is a common vLLM command line's).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def json_object_option(value: str | None, option: str) -> dict | None:
    """OPTION's JSON object; anything else is a usage error naming the option."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=f"'{option}'") from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter(f"must be a JSON object, got {value!r}", param_hint=f"'{option}'")
    return parsed


def override_generation_config_option(value: str | None) -> dict | None:
    """--override-generation-config's JSON object, checked as EngineConfig checks it; a bad one is a
    usage error naming the option."""
    if value is None:
        return None
    from minillm.generation_config import describe_ignored_override_keys, override_sampling_defaults
    try:
        override = json.loads(value)
    except ValueError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint="'--override-generation-config'") from None
    try:
        override_sampling_defaults(override)
    except ValueError as exc:
        raise typer.BadParameter(" ".join(str(exc).split()), param_hint="'--override-generation-config'") from None
    ignored = describe_ignored_override_keys(override)
    if ignored is not None:
        typer.echo(f"minillm: --override-generation-config: {ignored}", err=True)
    return override


def revision_option(value: str | None) -> str | None:
    """--revision, unless empty: an unset variable in `--revision "$REV"` was sent to the hub as a
    revision named ''."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty; give a branch, tag or commit, or leave it out (main)",
                                 param_hint="'--revision'")
    return value


def download_dir_option(value: str | None) -> str | None:
    """--download-dir, unless empty or blank: an unset variable in `--download-dir "$DIR"` read as the
    Hugging Face cache, and " " as a folder of that name in the working directory."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty; give a directory, or leave it out (the Hugging Face cache)",
                                 param_hint="'--download-dir'")
    return value


def kv_cache_memory_bytes_option(value: str | None) -> int | None:
    """--kv-cache-memory-bytes as vLLM reads it (4G, 512M, 1.5g, a plain byte count; 512MiB too); a
    bad one is a usage error naming the option."""
    if value is None:
        return None
    from minillm.config import parse_memory_bytes
    try:
        return parse_memory_bytes(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--kv-cache-memory-bytes'") from None


def max_model_len_option(value: str | None) -> int | None:
    """--max-model-len as vLLM reads it (2048, 1k, 1K, auto, -1); a bad one is a usage error naming the option."""
    if value is None:
        return None
    from minillm.config import parse_max_model_len
    try:
        return parse_max_model_len(value)
    except ValueError as exc:
        message = str(exc).removeprefix("max_model_len ") + binary_decimal_hint(value)
        raise typer.BadParameter(message, param_hint="'--max-model-len'") from None


# vLLM's human_readable_int: k, m, g, t powers of ten (decimals allowed), K, M, G, T powers of two (whole only).
_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_COUNT_SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
TOKEN_COUNT_FORMS = "a token count (8192, 8k = 8000, 8K = 8192, 2.5k)"


def binary_decimal_hint(value) -> str:
    """vLLM's hint for a decimal count with a power-of-two suffix (1.5K: did you mean 1.5k?), else ""."""
    match = _TOKEN_COUNT.fullmatch(str(value).strip())
    if match is None or "." not in match[1] or not match[2].isupper():
        return ""
    return f" (decimals are not taken with {match[2]}, a power of two: did you mean {match[1]}{match[2].lower()}?)"


def max_num_batched_tokens_option(value: str | int) -> int:
    """--max-num-batched-tokens as vLLM reads it (its human_readable_int: 8192, 8k, 8K, 2.5k); a bad one is
    a usage error naming the option."""
    match = _TOKEN_COUNT.fullmatch(str(value).strip())
    if match is None or ("." in match[1] and match[2] in ("", "K", "M", "G", "T")):
        raise typer.BadParameter(f"must be {TOKEN_COUNT_FORMS}, got {str(value)!r}{binary_decimal_hint(value)}",
                                 param_hint="'--max-num-batched-tokens'")
    number, suffix = match.groups()
    return int(float(number) * _COUNT_SCALES[suffix]) if "." in number else int(number) * _COUNT_SCALES[suffix]


# name -> (annotation, default); each becomes a keyword-only parameter of the decorated command.
ENGINE_OPTIONS: dict[str, tuple[object, object]] = {
    "device": (Annotated[Device, _engine_option(
        "--device", help="Backend: cpu (NumPy), cuda (CuPy kernels) or auto.")], Device(_default("device"))),
    "dtype": (Annotated[DType, _engine_option(
        "--dtype", help="Weights and activations dtype (half and float: vLLM's names of float16 and "
        "float32).")], DType(_default("dtype"))),
    "max_num_seqs": (Annotated[int, _engine_option(
        "--max-num-seqs", help="Most sequences in one step.")], _default("max_num_seqs")),
    "max_num_batched_tokens": (Annotated[str, _engine_option(
        "--max-num-batched-tokens", metavar="<int>", callback=max_num_batched_tokens_option,
        help="Token budget of one step, as vLLM takes it: 8192, 8k (8000), 8K (8192).")],
        str(_default("max_num_batched_tokens"))),
    "enable_chunked_prefill": (Annotated[bool, _engine_option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill", help="Split a long prompt into chunks that fit "
        "the step's token budget (vLLM's); --no-enable-chunked-prefill runs each prompt whole in one step, and "
        "needs --max-num-batched-tokens of at least --max-model-len.")], _default("enable_chunked_prefill")),
    "max_step_ms": (Annotated[Optional[float], _engine_option(
        "--max-step-ms", help="Step-time budget while decodes run: prompt chunks are sized to keep "
        "the estimated step within it (default: off, the token budget only).")], None),
    "max_step_factor": (Annotated[Optional[float], _engine_option(
        "--max-step-factor", help="Step-time budget relative to the batch: a step with prompt chunks may "
        "take this many times the estimated step of the batch's decodes (prompts waiting to join counted "
        "as decodes), e.g. 1.4 (default: off).")], None),
    "scheduling_policy": (Annotated[SchedulingPolicy, _engine_option(
        "--scheduling-policy", help="fcfs: requests in arrival order; priority: by each request's priority "
        "(lower first, then arrival; a server request's \"priority\" field), the lowest preempted first.")],
        SchedulingPolicy(_default("scheduling_policy"))),
    "max_model_len": (Annotated[Optional[str], _engine_option(
        "--max-model-len", metavar="<int>", callback=max_model_len_option,
        help="Longest prompt + output (default: the model's, lowered to what the KV pool holds), as vLLM takes "
             "it: 2048, 1k (1000), 1K (1024), or auto (or -1) for the default.")], None),
    "block_size": (Annotated[int, _engine_option(
        "--block-size", help="Tokens per KV block (a power of two).")], _default("block_size")),
    "num_kv_blocks": (Annotated[Optional[int], _engine_option(
        "--num-kv-blocks", "--num-gpu-blocks-override",
        help="KV pool size in blocks (default: sized from memory; vLLM's --num-gpu-blocks-override).")], None),
    "gpu_memory_utilization": (Annotated[float, _engine_option(
        "--gpu-memory-utilization", help="Share of GPU memory the engine may use (not used on the CPU).")],
        _default("gpu_memory_utilization")),
    "kv_cache_memory_bytes": (Annotated[Optional[str], _engine_option(
        "--kv-cache-memory-bytes", metavar="BYTES", callback=kv_cache_memory_bytes_option,
        help="Memory for the KV pool, as vLLM takes it: 4G or 512MiB (powers of two), 1.5g (powers of ten) or "
             "bytes (default: on the GPU what --gpu-memory-utilization leaves; on the CPU $VLLM_CPU_KVCACHE_SPACE "
             "GiB, else 4 GiB, capped at what --max-num-seqs sequences of --max-model-len can fill).")], None),
    "threads": (Annotated[Optional[int], _engine_option(
        "--threads", "-t", min=1, max=MAX_BLAS_THREADS, metavar="N", help="BLAS threads of the CPU backend, as "
        "llama.cpp's -t (default: $OPENBLAS_NUM_THREADS or $OMP_NUM_THREADS, else every CPU but one).")], None),
    "enable_prefix_caching": (Annotated[bool, _engine_option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prefixes.")],
        _default("enable_prefix_caching")),
    "enforce_eager": (Annotated[bool, _engine_option(
        "--enforce-eager", help="Never capture CUDA graphs.")], _default("enforce_eager")),
    "tensor_parallel_size": (Annotated[int, _engine_option(
        "--tensor-parallel-size", "-tp", help="Processes the model is split over (CPU for now).")],
        _default("tensor_parallel_size")),
    "load_format": (Annotated[LoadFormat, _engine_option(
        "--load-format", help="auto (or safetensors): the checkpoint's weights; dummy: random weights of its "
                              "shape (benchmarks).")],
        LoadFormat(_default("load_format"))),
    "download_dir": (Annotated[Optional[str], _engine_option(
        "--download-dir", callback=download_dir_option, help=f"Where hub models are stored ({STORE_DEFAULT}).")],
        None),
    "kv_offload_gib": (Annotated[float, _engine_option(
        "--kv-offload-gib", help="Host-memory tier of the prefix cache, GiB (0: off).")], _default("kv_offload_gib")),
    "kv_cache_dtype": (Annotated[str, _engine_option(
        "--kv-cache-dtype", metavar="[auto|fp8|fp8_e4m3]",
        help="KV cache storage: auto (the model dtype) or fp8 (FP8 E4M3, twice the tokens per byte).")],
        _default("kv_cache_dtype")),
    "generation_config": (Annotated[str, _engine_option(
        "--generation-config", metavar="[auto|vllm|FOLDER]",
        help="auto: a request's unset temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
             "take the model's generation_config.json values; vllm: ignore that file; a folder: its "
             "generation_config.json in place of the model's.")],
        _default("generation_config")),
    "override_generation_config": (Annotated[Optional[str], _engine_option(
        "--override-generation-config", metavar="JSON", callback=override_generation_config_option,
        help='Sampling defaults by generation_config.json\'s names, as vLLM takes them: {"temperature": 0.5, '
             '"max_new_tokens": 64} (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; null '
             'unsets one), over the file\'s (--generation-config auto) or alone (vllm); max_new_tokens also caps '
             'a server request\'s max_tokens.')], None),
    "revision": (Annotated[Optional[str], _engine_option(
        "--revision", callback=revision_option, help="A hub model's branch, tag or commit (default: main).")], None),
    "tokenizer": (Annotated[Optional[str], _engine_option(
        "--tokenizer", metavar="DIR_OR_HUB_ID",
        help="Read tokenizer.json, tokenizer_config.json and the chat template from this directory or hub id instead "
             "of the model's (vLLM's); config.json and generation_config.json stay the model's.")], None),
    "tokenizer_revision": (Annotated[Optional[str], _engine_option(
        "--tokenizer-revision", help="A hub tokenizer's branch, tag or commit (default: --revision, as vLLM's).")],
        None),
    "tokenizer_mode": (Annotated[str, _engine_option(
        "--tokenizer-mode", metavar="[auto|hf]", help="vLLM's: auto and hf both read tokenizer.json with the fast "
                                                      "tokenizers library (slow, mistral and custom are not taken).")],
        _default("tokenizer_mode")),
    "async_scheduling": (Annotated[Optional[bool], _engine_option(
        "--async-scheduling/--no-async-scheduling",
        help="Launch each step before the previous one is read back (default: on the GPU, off on the CPU).")],
        _default("async_scheduling")),
    "grammar_process": (Annotated[Optional[bool], _engine_option(
        "--grammar-process/--no-grammar-process",
        help="Keep structured outputs' grammar matchers in a process of their own, off the engine's thread and "
             "its GIL (default: on the GPU, off on the CPU).")],
        _default("grammar_process")),
    "max_logprobs": (Annotated[int, _engine_option(
        "--max-logprobs", help="The most log-probabilities a request may ask for, a token.")],
        _default("max_logprobs")),
    "calculate_kv_scales": (Annotated[bool, _engine_option(
        "--calculate-kv-scales", help="With --kv-cache-dtype fp8: k_scale and v_scale from the first prefill "
        "(default: 1.0).")], _default("calculate_kv_scales")),
    "speculative_config": (Annotated[Optional[str], _engine_option(
        "--speculative-config", metavar="JSON", help='Speculative decoding, as vLLM takes it: '
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.')],
        None),
}


def with_engine_options(command: Callable) -> Callable:
    """Add the engine options to COMMAND's signature and hand them to it as `engine_options`."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "engine_options"]
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann)
             for name, (ann, default) in ENGINE_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(**kwargs):
        options = {name: _plain(kwargs.pop(name)) for name in ENGINE_OPTIONS}
        options["dtype"] = DTYPE_ALIASES.get(options["dtype"], options["dtype"])
        return command(engine_options=options, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def _plain(value):
    """Enum choices as their string values."""
    return value.value if isinstance(value, Enum) else value


def engine_config(model_path: str, options: dict, **overrides) -> EngineConfig:
    """The EngineConfig for a resolved model directory and the engine options given (--revision
    chose the directory: it is not passed on)."""
    options = {k: v for k, v in options.items() if k not in ("revision", "threads")}
    return EngineConfig(model=model_path, **options, **overrides)


# ---------------------------------------------------------------------------------------------
# The engine options in a benchmark's argparse parser (minillm bench throughput takes generate's)
# ---------------------------------------------------------------------------------------------

# Engine options that set no EngineConfig field (--threads sets this process's BLAS threads).
NOT_ENGINE_FIELDS = ("threads",)


def add_engine_arguments(parser, options: dict[str, tuple[object, object]] | None = None) -> list[str]:
    """OPTIONS (ENGINE_OPTIONS by default; name -> (annotation, default), as serve's signature declares
    an option too) as options of an argparse PARSER, with the names, help and defaults `minillm generate`
    gives them; one PARSER already has (by its dest) keeps its own. Returns the names added."""
    have, added = {a.dest for a in parser._actions}, []
    for name, (annotation, default) in (ENGINE_OPTIONS if options is None else options).items():
        if name in have or name in NOT_ENGINE_FIELDS:
            continue
        kind, info = annotation.__args__[0], annotation.__metadata__[0]
        decls = [d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("-")] \
            or [f"--{name.replace('_', '-')}"]
        kw = dict(dest=name, default=_plain(default), help=info.help)
        if kind in (bool, Optional[bool]):
            on, _, off = decls[0].partition("/")
            parser.add_argument(on, *decls[1:], action=_Toggle if off else "store_true", **kw)
            added.append(name)
            continue
        kind = next(k for k in getattr(kind, "__args__", (kind,)) if k is not type(None))
        many = typing.get_origin(kind) is list          # vLLM's nargs="+" (--served-model-name a b)
        kind = typing.get_args(kind)[0] if many else kind
        choices = [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, Enum) else None
        parser.add_argument(*decls, type=None if choices else _argument_type(info, kind), choices=choices,
                            nargs="+" if many else None,
                            metavar=info.metavar or (None if choices else f"<{kind.__name__}>"), **kw)
        added.append(name)
    return added


# serve's options that set the engine, besides ENGINE_OPTIONS: EngineConfig's fields, and vLLM's
# trust_remote_code (LLM's and EngineArgs' VLLM_ONLY_DEFAULTS).
SERVE_ENGINE_OPTIONS = ("seed", "served_model_name", "kv_transfer_config", "structured_outputs_config",
                        "trust_remote_code")


def add_engine_args_cli(parser) -> list[str]:
    """vLLM's EngineArgs.add_cli_args: --model (default vLLM's, DEFAULT_CHAT_MODEL), ENGINE_OPTIONS and
    SERVE_ENGINE_OPTIONS as `minillm serve` declares them, each with its field's name as its dest. Returns
    the names added."""
    added = []
    if "model" not in {a.dest for a in parser._actions}:
        parser.add_argument("--model", dest="model", default=DEFAULT_CHAT_MODEL, metavar="MODEL",
                            help=f"Model directory or hub id (default: {DEFAULT_CHAT_MODEL}).")
        added.append("model")
    serve_options = {p.name: (p.annotation, p.default) for p in serve_parameters() if p.name in SERVE_ENGINE_OPTIONS}
    return added + add_engine_arguments(parser, {**ENGINE_OPTIONS, **serve_options})


class _Toggle(argparse.BooleanOptionalAction):
    """argparse's --x/--no-x action, without the "(default: ...)" it adds to the help."""

    def __init__(self, option_strings, dest, default=None, help=None, **kw):
        super().__init__(option_strings, dest, default=default, **kw)
        self.help = help


def _argument_type(info, kind: type) -> Callable:
    """The argparse type of an engine option: its typer callback or type, and its least value."""
    def convert(text: str):
        value = kind(text) if info.callback is None else text
        if info.min is not None and value < info.min:
            raise argparse.ArgumentTypeError(f"must be at least {info.min}, got {value}")
        try:
            return value if info.callback is None else info.callback(value)
        except typer.BadParameter as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
    convert.__name__ = kind.__name__      # argparse's "invalid int value: 'x'"
    return convert


def engine_flag_words(exc: ValueError, *others: str) -> str | None:
    """An EngineConfig ValueError in the words of the engine options and of the OTHERS named ("block_size
    must be a power of two" -> "--block-size must be ..."); None when it starts with none of their names."""
    flags = {name: (f"--{name.replace('_', '-')}", None) for name in others}
    for name, (annotation, _) in ENGINE_OPTIONS.items():
        info = annotation.__metadata__[0]
        on, _, off = next(d for d in (info.default, *info.param_decls) if str(d).startswith("--")).partition("/")
        flags[name] = (on, off or None)
    text = " ".join(str(exc).split())
    name = text.split(" ", 1)[0].rstrip(":").partition(".")[0]
    return None if name not in flags else in_flag_words(text, name, flags[name][0], flags)


# ctx.meta key: {field: option} for a field the command line set through another option than its
# own (serve's kv_transfer_config from --kv-role alone), so that an error about it names that option.
OPTION_ALIASES = "minillm.option_aliases"


@contextlib.contextmanager
def option_values(ctx: typer.Context, unless: tuple[str, ...] = ()):
    """Checks of option values in the block: a ValueError naming one of the command's options by its
    Python name first, as SamplingParams and EngineConfig name a field ("top_p must be in (0, 1]"),
    is a usage error (status 2) naming the option instead; any other goes on as it is, as does one
    naming an option in `unless` (a value that did not come from it)."""
    try:
        yield
    except ValueError as exc:
        usage = None if str(exc).split(" ", 1)[0] in unless else option_usage_error(ctx, exc)
        if usage is None:
            raise
        raise usage from None


def option_usage_error(ctx: typer.Context, exc: ValueError) -> UsageError | None:
    """exc as click's usage error for the option its message starts with ("Invalid value for
    '--top-p': must be in (0, 1], got 2.0"; a key of an option's JSON object after a dot:
    kv_transfer_config.kv_connector), or for the two options of "X and Y cannot be combined"
    ("--kv-transfer-config and --kv-offload-gib cannot be combined"); None when it starts with no
    option's name. Other names in the text are flags only where they are the engine's settings
    ("raise num_kv_blocks" -> "raise --num-kv-blocks"): any other may be a JSON object's key."""
    params = [p for p in ctx.command.params if p.param_type_name == "option" and p.opts]
    options = {p.name: _long_name(p.opts) for p in params}
    options.update({name: options[alias] for name, alias in ctx.meta.get(OPTION_ALIASES, {}).items()})
    name, _, rest = " ".join(str(exc).split()).partition(" ")
    name, dot, key = name.rstrip(":").partition(".")      # kv_transfer_config.kv_connector: a key of the JSON
    flag = options.get(name)
    if flag is None:
        return None
    if dot:
        rest = f"{key} {rest}"
    both = re.match(r"and (\w+) (.*)", rest)
    if both is not None and both[1] in options:
        return UsageError(f"{flag} and {options[both[1]]} {both[2]}", ctx=ctx)
    engine = {} if dot else engine_setting_flags(params)
    return typer.BadParameter(in_flag_words(rest, name, flag, engine), ctx=ctx, param_hint=f"'{flag}'")


def engine_setting_flags(params) -> dict[str, tuple[str, str | None]]:
    """The command's options that set an EngineConfig field of a snake_case name, by that name:
    (its flag, its --no- form or None)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig) if "_" in f.name}
    return {p.name: (_long_name(p.opts), p.secondary_opts[0] if p.secondary_opts else None)
            for p in params if p.name in fields}


def in_flag_words(text: str, name: str, flag: str, engine: dict[str, tuple[str, str | None]] | None = None) -> str:
    """TEXT of a ValueError about option NAME in the command line's words: the option's own Python name
    is its FLAG ("lower kv_cache_memory_bytes" -> "lower --kv-cache-memory-bytes"), and "(or None: X)",
    the Python API's way to turn it off, is "(or left out: X)". ENGINE (engine_setting_flags) names
    the engine's settings the text may name besides: each is its flag ("raise num_kv_blocks" ->
    "raise --num-kv-blocks", "enable_chunked_prefill False" -> "--no-enable-chunked-prefill"), but not
    quoted ('max_model_len', a key the text quotes) nor in a file name."""
    for other, (on, off) in (engine or {}).items():
        word = rf"(?<![\w'\"-]){re.escape(other)}(?![\w'\"]|\.\w)"
        if off is not None:
            text = re.sub(rf"{word} False\b", off, text)
            text = re.sub(rf"{word} True\b", on, text)
        text = re.sub(word, on, text)
    text = re.sub(rf"(?<![\w-]){re.escape(name)}(?!\w|\.\w)", flag, text)   # not generation_config.json
    return text.replace("(or None: ", "(or left out: ")


def _long_name(opts: list[str]) -> str:
    """An option's name in messages: its first long name (--num-kv-blocks, not the vLLM alias after it)."""
    return next((o for o in opts if o.startswith("--")), max(opts, key=len))


def check_engine_options(ctx: typer.Context, model: str | None, options: dict, **overrides) -> None:
    """The engine options checked as EngineConfig checks them, before the model is fetched or loaded:
    a bad value is a usage error naming its option. Then the CPU's settings (cpu_options)."""
    with option_values(ctx):
        engine_config(model or "", options, **overrides)
    if options["num_kv_blocks"] is not None and options["kv_cache_memory_bytes"] is not None:
        # As vLLM's --num-gpu-blocks-override, the block count wins; the budget beside it is said unused.
        typer.echo(f"minillm: --kv-cache-memory-bytes is not used: --num-kv-blocks sets the KV pool's size "
                   f"({options['num_kv_blocks']} blocks)", err=True)
    cpu_options(ctx, options)


def cpu_options(ctx: typer.Context, options: dict) -> None:
    """--threads for this process and those it starts (as OPENBLAS_NUM_THREADS and OMP_NUM_THREADS);
    on the CPU backend, the KV budget checked against the memory there is (a usage error naming
    --kv-cache-memory-bytes), and a line saying where it came from when a flag or the environment
    set it, and that --gpu-memory-utilization is not used there."""
    from importlib.util import find_spec

    from minillm.device import KV_SPACE_VARIABLE, THREAD_VARIABLES, cpu_kv_budget
    if options["threads"] is not None:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(options["threads"])
    if not (options["device"] == "cpu" or options["device"] == "auto" and find_spec("cupy") is None):
        return
    notes = []
    if options["num_kv_blocks"] is None:
        ranks = options.get("tensor_parallel_size")      # one pool a rank, all in this host's memory
        with option_values(ctx):
            budget = cpu_kv_budget(options["kv_cache_memory_bytes"],
                                   ranks if isinstance(ranks, int) and ranks > 1 else 1)
        if budget.source != "default":
            from minillm.engine_stats import human_bytes
            where = ("--kv-cache-memory-bytes" if budget.source == "kv_cache_memory_bytes"
                     else f"{KV_SPACE_VARIABLE}={os.environ[KV_SPACE_VARIABLE].strip()}")
            notes.append(f"CPU KV budget {human_bytes(budget.num_bytes)} from {where}")
    if ctx.get_parameter_source("gpu_memory_utilization").name == "COMMANDLINE":
        notes.append("--gpu-memory-utilization is not used on the CPU (--kv-cache-memory-bytes or "
                     f"{KV_SPACE_VARIABLE} sizes the KV pool)")
    if notes:
        typer.echo(f"minillm: {'; '.join(notes)}", err=True)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

# A model's page on the hub (https://huggingface.co/ORG/NAME/...), or Ollama's hf.co/ORG/NAME
HUB_MODEL_URL = re.compile(r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/(?!datasets/|spaces/)([^/?#]+/[^/?#]+)")


def check_model_name(model: str | None) -> None:
    """A CliError for an empty MODEL argument (it read as the current directory, or as the default model),
    or for a model's web address that is no local directory (it read as a path, not found)."""
    if model is not None and not model.strip():
        raise CliError(f"MODEL is empty: give a model directory or a Hugging Face repo id such as {DEFAULT_CHAT_MODEL}")
    url = HUB_MODEL_URL.match(model or "")
    if url is not None and not _path_test(expand_user(model).exists):
        raise CliError(f"{model} is a web address; give the model's Hugging Face repo id: {url[1]}")


def check_download_dir(download_dir: str | None) -> None:
    """A CliError when --download-dir is a file, or lies under one: the store is a folder."""
    if download_dir is None:
        return
    path = expand_user(download_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        under = "" if existing == path else f" ({existing} is a file)"
        raise CliError(f"--download-dir {download_dir} is not a directory{under}")


def resolve_model(model: str, download_dir: str | None, revision: str | None = None) -> str:
    """A local model directory for MODEL: a path as it is, a hub id fetched into the store (at revision)."""
    from minillm.loader import resolve_model_path
    check_model_name(model)
    check_download_dir(download_dir)
    return str(resolve_model_path(model, download_dir, revision))


def resolve_tokenizer(ctx: typer.Context, model: str, model_path: str, options: dict) -> dict:
    """The engine options with --tokenizer as a local directory: a hub id's tokenizer files from the
    store (fetched when missing) at --tokenizer-revision, else --revision, as vLLM's; --tokenizer-revision
    alone names a version of MODEL's (the model as given). A tokenizer that cannot be read, or that
    does not fit the model at MODEL_PATH, is a usage error naming its flag before any process starts."""
    if options["tokenizer"] is None and options["tokenizer_revision"] is None:
        return options
    from minillm.model_store import resolve_tokenizer_path
    from minillm.tokenizer import Tokenizer
    with option_values(ctx):
        path = resolve_tokenizer_path(options["tokenizer"] or model, options["download_dir"],
                                      options["tokenizer_revision"], options["revision"])
        Tokenizer.from_pretrained(path, renders_chat=False, model_path=model_path)
    return {**options, "tokenizer": str(path), "tokenizer_revision": None}


def check_model_tokenizer(model_path: str, options: dict, api_server_count: int) -> None:
    """The model's own tokenizer read once here when several API server processes would each fail on
    it: a CliError saying what is wrong before any process starts (resolve_tokenizer read a --tokenizer)."""
    if api_server_count < 2 or options["tokenizer"] is not None:
        return
    from minillm.tokenizer import Tokenizer
    try:
        Tokenizer.from_pretrained(model_path, renders_chat=False)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def load_engine(config: EngineConfig):
    """Build an LLMEngine and report what was loaded on stderr."""
    from minillm.engine import LLMEngine
    from minillm.engine_stats import describe_engine
    engine = LLMEngine(config)
    typer.echo(describe_engine(engine.stats(cells=1)), err=True)
    return engine


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

def sampling_settings(chosen: dict, max_tokens: int, seed: int | None):
    """ChatSettings from the command line (CHOSEN: the temperature, top_p and top_k given),
    validated before anything loads."""
    from minillm.chat import ChatSettings
    settings = ChatSettings(**chosen, max_tokens=max_tokens, seed=seed)
    settings.sampling_params()
    return settings


def resolve_chat_model(model: str | None, download_dir: str | None, command: str = "chat",
                       revision: str | None = None) -> str:
    """MODEL, else $MINILLM_MODEL, else the default; a failed fetch says how to use a local dir."""
    check_model_name(model)
    check_download_dir(download_dir)     # before the fallback below reads it as a failed fetch
    check_model_variable(model)
    name = model or os.environ.get("MINILLM_MODEL") or DEFAULT_CHAT_MODEL
    if model is not None:
        return resolve_model(name, download_dir, revision)
    check_model_name(name)      # $MINILLM_MODEL as a web address: said as it is, not as a failed fetch
    try:
        return resolve_model(name, download_dir, revision)
    except Exception as exc:   # network, hub and disk errors all end the same way for the user
        root = exc.__cause__ or exc
        reason = f"{type(root).__name__}: {_one_line(root)}"
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise CliError(f"could not fetch the default model {name} ({reason}); pass a local model "
                       f"directory instead: minillm {command} path/to/model (or set MINILLM_MODEL)") from None


def check_model_variable(model: str | None) -> None:
    """A CliError for a $MINILLM_MODEL of spaces that MODEL left out would read (empty, it is unset)."""
    value = os.environ.get("MINILLM_MODEL")
    if model is None and value and not value.strip():
        raise CliError("$MINILLM_MODEL is blank: set it to a model directory or a Hugging Face repo id such as "
                       f"{DEFAULT_CHAT_MODEL}, or unset it")


def _use_readline() -> None:
    """Line editing and history at the prompt, where the terminal supports it."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what enables editing in input())
        except ImportError:
            pass


@app.command(cls=MinillmCommand)
@with_engine_options
def chat(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        help=f"Model directory or hub id (default: $MINILLM_MODEL or {DEFAULT_CHAT_MODEL}); "
             "with --url, the served model name.")] = None,
    url: Annotated[Optional[str], typer.Option(
        help="Chat with a running `minillm serve` at this URL instead of loading a model.")] = None,
    model_name: Annotated[Optional[str], typer.Option(
        "--model-name", metavar="MODEL", help="MODEL given as an option, as vLLM's chat --model-name.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="API key for --url (default: $OPENAI_API_KEY, as vLLM's chat takes it).")] = None,
    system: Annotated[Optional[str], typer.Option(
        "--system", "--system-prompt", help="System message (--system-prompt: vLLM's name).")] = None,
    quick: Annotated[Optional[str], typer.Option(
        "--quick", "-q", metavar="MESSAGE",
        help="Send MESSAGE as the one message, print the reply and exit (as vLLM's chat --quick).")] = None,
    chat_template: Annotated[Optional[str], typer.Option(
        help="A Jinja chat template, as a file or the template itself; replaces the model's own "
             "(a model without one needs it to chat in turns). With --url it goes with each request, "
             "which the server renders only when started with --trust-request-chat-template.")] = None,
    temperature: Annotated[Optional[float], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help=f"{CHAT_MODEL_DEFAULT} 0.7.")] = None,
    top_p: Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING_PANEL, help=f"{CHAT_MODEL_DEFAULT} 0.9.")] = None,
    top_k: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help=f"-1: off. {CHAT_MODEL_DEFAULT} -1.")] = None,
    max_tokens: Annotated[int, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Most tokens a reply (/set max_tokens N changes it).")] = 256,
    seed: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Seed for sampling each reply (-1: none; default: none).")] = None,
    *,
    engine_options: dict,
) -> None:
    """Chat in the terminal; replies stream as they are written.

    Inside the chat, /help lists the commands.
    """
    from minillm.chat import ChatSession, EngineChatBackend
    from minillm.tokenizer import read_chat_template
    model = model_from_option(model, model_name, "--model-name")
    if quick is not None and not quick.strip():      # `-q "$MESSAGE"` with the variable unset
        raise typer.BadParameter("is empty; give the message to send", param_hint="'--quick'")
    if quick is None and sys.stdin is None:   # started with stdin closed (<&-): there is nothing to read messages from
        raise CliError("chat reads your messages from stdin, which is closed")
    require_stdout("chat")     # its replies go there: input() said only "lost sys.stdout"
    chosen = {k: v for k, v in {"temperature": temperature, "top_p": top_p, "top_k": top_k}.items() if v is not None}
    with option_values(ctx):
        settings = sampling_settings(chosen, max_tokens, seed)
    if system is not None:
        check_utf8(system, "--system")      # else every message fails on it, naming neither the option nor the byte
    if quick is not None:
        check_utf8(quick, "--quick")
    template = chat_template_option(chat_template, read_chat_template) if chat_template is not None else None
    if url is not None:      # an empty one (`--url "$SERVER"` unset) is named, not read as "load a model"
        from minillm.chat_client import HttpChatBackend
        server_url_option(url, "--url")
        refuse_engine_options(ctx, "--url", "chat talks to that server and loads no engine (the server's own "
                                           "settings apply); leave it out")
        api_key_option(api_key)
        if api_key is None:
            api_key = openai_key_variable()
        backend = HttpChatBackend(url, api_key=api_key, model=model,   # model None: the server's first
                                  chat_template=template)
    else:
        check_engine_options(ctx, model, engine_options)
        path = resolve_chat_model(model, engine_options["download_dir"],
                                  revision=engine_options["revision"])
        engine_options = resolve_tokenizer(ctx, model or os.environ.get("MINILLM_MODEL") or DEFAULT_CHAT_MODEL,
                                           path, engine_options)
        with option_values(ctx):     # the engine's start-up refusing a value names its flag
            engine = load_engine(engine_config(path, engine_options))
        backend = EngineChatBackend(engine, name=model or Path(path).name, chat_template=template)
        try:
            backend.check_chat_template()
        except ValueError as exc:      # the model's file is at fault, not a flag: status 1
            raise CliError(f"{_one_line(exc)}; chat renders every message with the model's chat template: "
                           "fix it, or give one with --chat-template") from None
        model_defaults = {k: v for k, v in engine.sampling_defaults.items() if k in ("temperature", "top_p", "top_k")}
        settings = dataclasses.replace(settings, **{**model_defaults, **chosen})
    if quick is not None:       # errors and notices on stderr: stdout holds the reply alone
        raise typer.Exit(ChatSession(backend, settings, system=system, log=sys.stderr).reply_once(quick))
    _use_readline()
    raise typer.Exit(ChatSession(backend, settings, system=system).run())


def refuse_engine_options(ctx: typer.Context, flag: str, why: str) -> None:
    """A usage error naming the first engine option given on the command line beside FLAG, and WHY none
    is taken (they were passed over unread, a bad value among them too)."""
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if param.name in ENGINE_OPTIONS and source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            name = "/".join([_long_name(param.opts), *param.secondary_opts])     # a switch by both its forms
            raise UsageError(f"{name} is not taken with {flag}: {why}")


def chat_template_option(value: str, read: Callable[[str], str]) -> str:
    """--chat-template read by READ (a file or the template itself); a directory, a file that cannot
    be read, or an inline one that is not UTF-8 is a CliError naming the option (a directory read as 'no such file'); an empty one (an unset
    variable in `--chat-template "$T"`) is a usage error, not the model's own template."""
    if not value.strip():
        raise typer.BadParameter("is empty; give the template's file, or the template itself",
                                 param_hint="'--chat-template'")
    path = expand_user(value)
    if _path_test(path.is_dir):
        raise CliError(f"--chat-template {value} is a directory; give the template's file, or the template itself")
    try:
        if _path_test(path.is_file):
            path.open("rb").close()   # serve's reader took an unreadable file for no file at all
        template = read(value)
    except OSError as exc:
        raise CliError(f"--chat-template: cannot read {value}: {exc.strerror or exc}") from None
    check_utf8(template, "--chat-template")     # one given inline (a file's text is checked as it is read)
    return template


def _path_test(test: Callable[[], bool]) -> bool:
    """Path.is_dir() or is_file() of a value that may be a template rather than a path."""
    try:
        return test()
    except OSError:       # a template's text is often too long to be a file name
        return False


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

def read_prompts(prompts: list[str] | None, prompts_file: Path | None) -> list[str]:
    """The prompts from --prompt (repeatable; '-' is the whole of stdin, one prompt) or --prompts-file
    (one a line; '-' is stdin): both, or neither, or '-' twice, is a usage error; bytes that are not
    UTF-8 are a CliError naming where they came from."""
    if prompts and prompts_file:
        raise UsageError("--prompt and --prompts-file cannot be combined: give the prompts one way")
    if prompts and "-" in prompts:
        if prompts.count("-") > 1:
            raise typer.BadParameter("'-' reads stdin, which holds one prompt: give '-' once",
                                     param_hint="'--prompt'")
        prompts = [stdin_prompt() if p == "-" else p for p in prompts]
    for p in prompts or []:
        check_utf8(p, "--prompt")
    if prompts_file is not None:
        if str(prompts_file) == "-" and sys.stdin is None:   # started with stdin closed (<&-)
            raise CliError("--prompts-file -: stdin is closed; give a file, or pipe the prompts in")
        if str(prompts_file) == "-" and sys.stdin.isatty():
            typer.echo("minillm generate: reading the prompts from stdin, one a line (Ctrl-D ends them)", err=True)
        try:
            text = sys.stdin.read() if str(prompts_file) == "-" else prompts_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CliError(f"--prompts-file {prompts_file} is not UTF-8 text: {exc.reason} at byte "
                           f"{exc.start}") from None
        except OSError as exc:
            raise CliError(f"--prompts-file: cannot read {prompts_file}: {exc.strerror or exc}") from None
        check_utf8(text, f"--prompts-file {prompts_file}")
        prompts = prompt_lines(text)
        if not prompts:
            raise CliError(f"--prompts-file {prompts_file} holds no prompts")
    if not prompts:
        raise UsageError("give at least one --prompt TEXT or a --prompts-file FILE")
    return list(prompts)


def prompt_lines(text: str) -> list[str]:
    """The prompts of a --prompts-file's text: its lines that are not blank. Lines end at a line break
    alone (\n, \r\n or \r), not at the other characters str.splitlines breaks at (a form feed, U+2028,
    NEL), which a prompt may hold; a byte-order mark (editors on Windows write one) is no part of the first."""
    lines = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [line for line in lines if line.strip()]


def stdin_prompt() -> str:
    """--prompt -: the whole of stdin as one prompt (its lines kept), less the line break that ends it."""
    if sys.stdin is None:      # started with stdin closed (<&-)
        raise CliError("--prompt -: stdin is closed; pipe the prompt in, or give it as --prompt TEXT")
    if sys.stdin.isatty():
        typer.echo("minillm generate: reading the prompt from stdin (Ctrl-D ends it)", err=True)
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise CliError(f"--prompt -: stdin is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    text = text.rstrip("\r\n")
    check_utf8(text, "--prompt - (stdin)")
    if not text.strip():
        raise CliError("--prompt -: stdin holds no prompt")
    return text


def check_utf8(text: str, where: str) -> None:
    """A CliError naming WHERE when TEXT holds bytes that were not UTF-8: Python hands them on from
    the command line and stdin as lone surrogates, which the tokenizer refuses only after the model
    has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if "\udc80" <= bad <= "\udcff" else ""
        line = text.count("\n", 0, exc.start) + 1
        place = f"line {line}" if "\n" in text else f"character {exc.start + 1}"
        raise CliError(f"{where} is not UTF-8 text: {place}{byte}") from None


def output_record(out, tokenizer=None, num_top: int = 0, num_prompt_top: int = 0) -> dict:
    """One JSON line: the prompt, its ids and every completion (with logprobs when they were asked
    for, and the prompt's when prompt_logprobs was: None for its first token)."""
    prompt_ids = list(out.prompt_token_ids)
    record = {"prompt": out.prompt, "prompt_token_ids": prompt_ids,
              "outputs": [completion_record(c, tokenizer, num_top) for c in out.outputs]}
    if getattr(out, "prompt_logprobs", None) is not None:
        record["prompt_logprobs"] = logprob_records(prompt_ids, out.prompt_logprobs, tokenizer, num_prompt_top,
                                                    context_floor=1)
    return record


def completion_record(c, tokenizer=None, num_top: int = 0) -> dict:
    """A completion as JSON; logprobs in the OpenAI shape: token, logprob and the top alternatives."""
    record = {"index": c.index, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        record["cumulative_logprob"] = json_logprob(c.cumulative_logprob)
        record["logprobs"] = logprob_records(list(c.token_ids), c.logprobs, tokenizer, num_top)
    return record


def logprob_records(token_ids: list[int], entries: list, tokenizer=None, num_top: int = 0,
                    context_floor: int = 0) -> list:
    """token_logprobs of each token (None where its entry is), each token named as the server and
    LLM.generate's decoded_token name it, one that ends inside a character read after the tokens before it
    from CONTEXT_FLOOR on ("" while the character is unfinished)."""
    from minillm.server.logprobs import TokenTexts
    from minillm.tokenizer import MAX_LOGPROB_CONTEXT_TOKENS
    texts = None if tokenizer is None else TokenTexts(tokenizer)
    records = []
    for i, (token_id, entry) in enumerate(zip(token_ids, entries)):
        context = token_ids[max(context_floor, i - MAX_LOGPROB_CONTEXT_TOKENS):i]
        records.append(None if entry is None else token_logprobs(token_id, entry, texts, num_top, context))
    return records


def token_logprobs(token_id: int, logprobs: dict[int, float], texts=None, num_top: int = 0,
                   context: list[int] = ()) -> dict:
    """{token_id, token, logprob, top_logprobs} of one generated token; TEXTS (a TokenTexts) names each
    candidate, one that ends inside a character read after CONTEXT."""
    def text(i: int) -> str | None:
        return None if texts is None else texts.named(i, list(context))

    # logprobs holds the sampled token and the top num_top; the sampled one may rank below them
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:num_top]
    return {"token_id": token_id, "token": text(token_id), "logprob": json_logprob(logprobs.get(token_id)),
            "top_logprobs": [{"token_id": i, "token": text(i), "logprob": json_logprob(lp)} for i, lp in top]}


def json_logprob(logprob: float | None) -> float | None:
    """A logprob JSON can hold: -inf (a token a grammar or top-k ruled out) is -9999.0, as the server
    and vLLM write it (json.dumps would write -Infinity, which JSON readers refuse)."""
    return None if logprob is None else max(float(logprob), -9999.0)


def print_plain(outputs, tokenizer=None, num_top: int = 0, num_prompt_top: int = 0) -> None:
    """Each prompt followed by its completion(s), a blank line between them; logprobs below each, and
    the prompt's (when asked for) below its completions."""
    for i, out in enumerate(outputs):
        if i:
            typer.echo("")
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            typer.echo(f"{label}{out.prompt}{c.text}")
            if c.logprobs is not None:
                print_logprobs(completion_record(c, tokenizer, num_top))
        if getattr(out, "prompt_logprobs", None) is not None:
            typer.echo("  prompt logprobs (the first token has none):")
            records = logprob_records(list(out.prompt_token_ids), out.prompt_logprobs, tokenizer, num_prompt_top,
                                      context_floor=1)
            for t in records:
                if t is not None:
                    print_logprob_line(t)


def print_logprobs(record: dict) -> None:
    """One line per generated token: the token, its logprob and the alternatives."""
    typer.echo(f"  logprobs (cumulative {record['cumulative_logprob']:.3f}):")
    for t in record["logprobs"]:
        print_logprob_line(t)


def print_logprob_line(t: dict) -> None:
    """A token's line: the token, its logprob and the alternatives."""
    top = ", ".join(f"{alt['token']!r} {alt['logprob']:.3f}" for alt in t["top_logprobs"])
    typer.echo(f"  {t['token']!r:>14} {t['logprob']:8.3f}" + (f"   top: {top}" if top else ""))


@app.command(cls=MinillmCommand)
@with_engine_options
def generate(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model directory or hub id.")],
    prompt: Annotated[Optional[list[str]], typer.Option(
        "--prompt", "-p", help="A prompt (repeat for a batch; '-': all of stdin, one prompt).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        help="A file with one prompt per line ('-': stdin).")] = None,
    temperature: Annotated[Optional[float], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help=f"0: greedy. {MODEL_DEFAULT} 1.0.")] = None,
    top_p: Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING_PANEL, help=f"{MODEL_DEFAULT} 1.0.")] = None,
    top_k: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help=f"-1: off. {MODEL_DEFAULT} -1.")] = None,
    min_p: Annotated[Optional[float], typer.Option(rich_help_panel=SAMPLING_PANEL, help=f"{MODEL_DEFAULT} 0.")] = None,
    seed: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Seed for sampling, a signed 64-bit integer (-1: none; default: "
                                             "none), as SamplingParams' seed.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help=f"{MODEL_DEFAULT} 16 (max_new_tokens).")] = None,
    min_tokens: Annotated[int, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Generate at least this many tokens before EOS may stop.")] = 0,
    stop: Annotated[Optional[list[str]], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="A stop string (repeatable).")] = None,
    stop_token_ids: Annotated[Optional[list[int]], typer.Option(
        "--stop-token-id", rich_help_panel=SAMPLING_PANEL, help="A token id that stops (repeatable).")] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(
        rich_help_panel=SAMPLING_PANEL,
        help=f"> 1 discourages tokens already in the prompt or output. {MODEL_DEFAULT} 1.")] = None,
    presence_penalty: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="In [-2, 2]: subtracted once from every token already generated.")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="In [-2, 2]: subtracted per occurrence in the output.")] = 0.0,
    logprobs: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Show each token's logprob and this many top alternatives (0-20).")] = None,
    prompt_logprobs: Annotated[Optional[int], typer.Option(
        rich_help_panel=SAMPLING_PANEL,
        help="The same for each prompt token (0-20), below the completions (in the --json records' "
             "prompt_logprobs).")] = None,
    n: Annotated[int, typer.Option("--n", rich_help_panel=SAMPLING_PANEL,
                                   help="Completions per prompt.")] = 1,
    ignore_eos: Annotated[bool, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Go on past the end-of-sequence token, up to --max-tokens.")] = False,
    logit_bias: Annotated[Optional[list[str]], typer.Option(
        rich_help_panel=SAMPLING_PANEL, metavar="ID=BIAS",
        help="Add BIAS to token ID's logit before sampling (-inf bans it; repeatable).")] = None,
    allowed_token_ids: Annotated[Optional[list[int]], typer.Option(
        "--allowed-token-id", rich_help_panel=SAMPLING_PANEL,
        help="Sample only this token id and the others given (repeatable).")] = None,
    bad_words: Annotated[Optional[list[str]], typer.Option(
        "--bad-word", rich_help_panel=SAMPLING_PANEL, help="A word the output must not contain (repeatable).")] = None,
    json_schema: Annotated[Optional[Path], typer.Option(
        rich_help_panel=STRUCTURE_PANEL, help="Output JSON valid under the JSON schema in this file.")] = None,
    regex: Annotated[Optional[str], typer.Option(
        rich_help_panel=STRUCTURE_PANEL, help="Output that fully matches this regular expression.")] = None,
    choice: Annotated[Optional[list[str]], typer.Option(
        rich_help_panel=STRUCTURE_PANEL, help="Output exactly one of these strings (repeat the option).")] = None,
    grammar: Annotated[Optional[Path], typer.Option(
        rich_help_panel=STRUCTURE_PANEL, help="Output a sentence of the grammar (Lark or GBNF) in this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines out, one per prompt.")] = False,
    *,
    engine_options: dict,
) -> None:
    """Generate for a batch of prompts offline (LLM.generate)."""
    from minillm.sampling_params import SamplingParams
    require_stdout("generate")
    # Left unset, these take the model's generation_config.json values (--generation-config auto).
    model_defaulted = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                       "max_tokens": max_tokens, "repetition_penalty": repetition_penalty}
    options = dict(n=n, seed=seed, min_tokens=min_tokens, stop=list(stop or []) or None,
                   stop_token_ids=list(stop_token_ids or []), presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty, logprobs=logprobs, ignore_eos=ignore_eos,
                   logit_bias=logit_bias_option(logit_bias), prompt_logprobs=prompt_logprobs,
                   allowed_token_ids=list(allowed_token_ids) if allowed_token_ids else None,
                   bad_words=list(bad_words) if bad_words else None,
                   structured_outputs=structured_outputs_option(json_schema, regex, choice, grammar),
                   **{k: v for k, v in model_defaulted.items() if v is not None})
    with option_values(ctx):
        SamplingParams(**options)           # a bad flag fails before the model loads
    check_engine_options(ctx, model, engine_options)
    prompts = read_prompts(prompt, prompts_file)
    path = resolve_model(model, engine_options["download_dir"], engine_options["revision"])
    engine_options = resolve_tokenizer(ctx, model, path, engine_options)
    # Values only the model can judge (--top-k past its vocabulary, a prompt too long for its context).
    with option_values(ctx, unless=("prompt",) if prompts_file is not None else ()):
        llm, outputs = run_generate(engine_config(path, engine_options), prompts, options)
    tokenizer = llm.get_tokenizer()
    with stdout_errors():
        if as_json:
            for out in outputs:
                typer.echo(json.dumps(output_record(out, tokenizer, logprobs or 0, prompt_logprobs or 0),
                                      ensure_ascii=False))
        else:
            print_plain(outputs, tokenizer, logprobs or 0, prompt_logprobs or 0)
    failed = [c.stop_reason for out in outputs for c in out.outputs if c.finish_reason == "error"]
    if failed:
        # Printed above is what was generated before; the reason goes where errors go.
        for reason in dict.fromkeys(str(r) for r in failed):
            typer.echo(f"minillm generate: error: {reason}", err=True)
        raise typer.Exit(1)


def require_stdout(command: str) -> None:
    """A CliError when stdout is closed (`>&-`): COMMAND's output would be lost without a word."""
    if sys.stdout is None:
        raise CliError(f"{command} writes to stdout, which is closed; redirect it to a file (or to "
                       "/dev/null to discard it)")


@contextlib.contextmanager
def stdout_errors():
    """A failed write to stdout (a full disk) as a CliError that says so; a reader that went away
    (`| head`) is left to click, which ends the command quietly."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            raise
        raise CliError(f"cannot write to stdout: {exc.strerror or exc}") from None


_STRUCTURE_OPTIONS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def logit_bias_option(pairs: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID=BIAS options as SamplingParams' logit_bias (None when none is given)."""
    if not pairs:
        return None
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            if not sep or not token.strip().isdigit():
                raise ValueError
            token_id, value = int(token), float(value)
        except ValueError:
            # a usage error (status 2), as a NaN bias is
            raise UsageError(f"--logit-bias: expected ID=BIAS (a token id and a number), got {pair!r}") from None
        if token_id in bias and repr(bias[token_id]) != repr(value):     # one would be dropped unsaid (nan as nan)
            raise UsageError(f"--logit-bias: token {token_id} is given two biases ({bias[token_id]:g} and "
                             f"{value:g}); give it one")
        bias[token_id] = value
    return bias


def structured_outputs_option(json_schema: Path | None, regex: str | None, choice: list[str] | None,
                              grammar: Path | None):
    """StructuredOutputsParams from generate's structure options (None when none is given); a bad
    constraint, a file that cannot be read or holds no valid one, or two of the options together, is a
    usage error (status 2) naming the option, as every other bad option value is."""
    values = {"json": json_schema, "regex": regex, "choice": choice or None, "grammar": grammar}
    given = [name for name, value in values.items() if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one of {', '.join(_STRUCTURE_OPTIONS.values())}, not "
                         f"{' and '.join(_STRUCTURE_OPTIONS[g] for g in given)}")
    name = given[0]
    value = values[name]
    if name in ("json", "grammar"):
        try:
            value = value.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{_STRUCTURE_OPTIONS[name]}: {value} is not UTF-8 text: {exc.reason} at byte "
                             f"{exc.start}") from None
        except OSError as exc:
            raise UsageError(f"{_STRUCTURE_OPTIONS[name]}: cannot read {value}: {exc.strerror or exc}") from None
    from minillm.structured_output import StructuredOutputsParams
    try:
        return StructuredOutputsParams(**{name: value})
    except ValueError as exc:
        message = " ".join(str(exc).split(": ", 1)[-1].split())    # llguidance's errors span lines
        raise UsageError(f"{_STRUCTURE_OPTIONS[name]}: {message}") from None


def run_generate(config: EngineConfig, prompts: list[str], options: dict):
    """LLM.generate over the prompts with SamplingParams(**options) over the model's sampling
    defaults, a progress bar on stderr: (the LLM, its outputs)."""
    from minillm.engine_stats import describe_engine
    from minillm.llm import LLM
    llm = LLM(**dataclasses.asdict(config))
    typer.echo(describe_engine(llm.llm_engine.stats(cells=1)), err=True)
    params = dataclasses.replace(llm.get_default_sampling_params(), **options)
    return llm, llm.generate(prompts, params, use_tqdm=True)


# ---------------------------------------------------------------------------------------------
# serve, monitor
# ---------------------------------------------------------------------------------------------

SERVER_PANEL = "Server options"
KV_TRANSFER_PANEL = "KV transfer (prefill/decode disaggregation)"


def _server_option(*decls: str, help: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=SERVER_PANEL, **kw)


def _limit_default(name: str):
    """ServerLimits' own default, so the CLI never drifts from it."""
    from minillm.server.limits import ServerLimits
    return ServerLimits.__dataclass_fields__[name].default


# ServerLimits field -> the serve option that sets it
SERVER_LIMIT_OPTIONS = {
    "max_n": "--max-n", "max_prompts_per_request": "--max-prompts-per-request",
    "max_stop_strings": "--max-stop-strings", "max_stop_string_chars": "--max-stop-string-length",
    "max_stop_token_ids": "--max-stop-token-ids", "max_allowed_token_ids": "--max-allowed-token-ids",
    "max_prompt_chars": "--max-prompt-chars",
    "max_stats_streams": "--max-stats-streams", "stream_timeout_s": "--stream-timeout",
    "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
    "timeout_keep_alive_s": "--timeout-keep-alive",
}


def json_list_option(value: str, option: str) -> tuple[str, ...]:
    """OPTION's JSON list of strings, or a usage error naming it."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise typer.BadParameter(f"takes a JSON list of strings, such as '[\"*\"]', got {value!r}",
                                 param_hint=f"'{option}'")
    return tuple(items)


class SpreadValuesCommand(MinillmCommand):
    """A command whose options named in `spread_options` take several values after one flag, as vLLM's
    nargs="+" options do (--served-model-name a b): click takes one value a flag, so the values are
    handed to it one flag each (--served-model-name a --served-model-name b)."""

    spread_options: tuple[str, ...] = ()

    def parse_words(self, ctx, args: list[str]) -> list[str]:
        counts = option_value_counts(self.get_params(ctx))
        return super().parse_words(ctx, spread_option_values(args, self.spread_options, counts))


def spread_option_values(args: list[str], options: tuple[str, ...],
                         value_counts: dict[str, int] | None = None) -> list[str]:
    """ARGS with each of OPTIONS repeated before each of its values: its values are the arguments up to
    the next option, as argparse takes an nargs="+" option's (so MODEL goes before such an option). Only
    a word where an option may stand is one of OPTIONS (VALUE_COUNTS: how many values each option takes;
    the value of another option, or a word after a bare "--", is kept as it is)."""
    at_option = option_positions(args, {**(value_counts or {}), **dict.fromkeys(options, 1)})
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not at_option[i - 1]:
            out.append(arg)
            continue
        option = dashed_option_name(arg) if arg.startswith("--") else arg   # --served_model_name too
        if option not in options:
            out.append(arg)
            continue
        end = i
        while end < len(args) and not args[end].startswith("-"):
            end += 1
        out += [option] if end == i else [part for value in args[i:end] for part in (option, value)]
        i = end
    return out


class ServeCommand(SpreadValuesCommand):
    spread_options = ("--served-model-name", "--api-key")

    def parse_words(self, ctx, args: list[str]) -> list[str]:
        from minillm.cli_config import ConfigFileError, config_file_args
        try:
            flags = [*VLLM_FLAGS_NOT_TAKEN, *getattr(self, "refused_options", {})]
            reasons = {flag: vllm_flag_reason(flag, ctx) for flag in flags if flag.startswith("--")}
            args = config_file_args(args, *config_option_kinds(self.get_params(ctx)),
                                    reasons={flag: why for flag, why in reasons.items() if why})
        except ConfigFileError as exc:
            raise UsageError(str(exc), ctx=ctx) from None
        return super().parse_words(ctx, args)


def config_option_kinds(params) -> tuple[dict, dict[str, str]]:
    """The options a --config file may set ({dashless long name: OptionKind}), and every spelling of
    every option ({"-tp": "tensor_parallel_size", ...}, MODEL's --model included)."""
    from minillm.cli_config import OptionKind
    kinds, aliases = {}, {}
    for param in params:
        if param.param_type_name != "option" or param.name in ("config", "help"):
            continue
        names = [*param.opts, *param.secondary_opts]
        aliases.update(dict.fromkeys(names, "model" if param.name == "model_option" else param.name))
        flag = next(o for o in param.opts if o.startswith("--"))
        kind = OptionKind(param="model" if param.name == "model_option" else param.name, flag=flag,
                          is_flag=param.is_flag, off_flag=next(iter(param.secondary_opts), None),
                          is_multiple=param.multiple)
        kinds.update({o[2:]: kind for o in param.opts if o.startswith("--")})
    return kinds, aliases


class ChatTemplateContentFormat(str, Enum):
    auto = "auto"
    string = "string"
    openai = "openai"


class ToolCallParser(str, Enum):
    hermes = "hermes"
    llama3_json = "llama3_json"


class ReasoningParserName(str, Enum):
    deepseek_r1 = "deepseek_r1"
    qwen3 = "qwen3"


def auto_tool_parser(enabled: bool, parser: ToolCallParser | None, command: str = "minillm serve") -> str | None:
    """The tool call parser tool_choice "auto" is served with. --enable-auto-tool-choice without a
    parser is a usage error, as vLLM makes it; a parser without the flag is taken, as vLLM takes it,
    and said to change nothing."""
    if enabled and parser is None:
        raise typer.BadParameter("--enable-auto-tool-choice requires --tool-call-parser",
                                 param_hint="'--enable-auto-tool-choice'")
    if parser is not None and not enabled:
        typer.echo(f"{command}: --tool-call-parser {_plain(parser)} takes effect with --enable-auto-tool-choice "
                   f'only; tool_choice "auto" stays refused', err=True)
        return None
    return _plain(parser) if parser is not None else None


class UvicornLogLevel(str, Enum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


def host_option(value: str) -> str:
    """--host, unless empty: an unset variable in `--host "$HOST"` would bind every interface, which
    must be asked for by name."""
    if not value.strip():
        raise typer.BadParameter("is empty; give an address to bind, such as 127.0.0.1 (0.0.0.0 for every "
                                 "interface)", param_hint="'--host'")
    return value


def middleware_option(paths: list[str] | None) -> list[str] | None:
    """--middleware's import paths, each imported now so that a bad one is a usage error before the model loads."""
    from minillm.server.middleware import import_middleware
    for path in paths or ():
        try:
            import_middleware(path)
        except ValueError as exc:
            raise typer.BadParameter(str(exc).removeprefix("middleware "), param_hint="'--middleware'") from None
    return paths


def server_limits(**values):
    """ServerLimits from serve's options; a value no limit may take is a usage error naming its option."""
    from minillm.server.limits import ServerLimits
    for name, value in values.items():
        limit_option(SERVER_LIMIT_OPTIONS[name], value)
    return ServerLimits(**values)


def limit_option(option: str, value: float) -> None:
    """A usage error naming OPTION unless VALUE is a finite number > 0 (server.limits.check_limit)."""
    from minillm.server.limits import check_limit
    try:
        check_limit(option, value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{option} "), param_hint=f"'{option}'") from None


def server_options(ctx: typer.Context, given: dict, served_model_name, **settings):
    """The ServerOptions of serve's option values GIVEN (each of serve's options by its name) for the names
    SERVED_MODEL_NAME, SETTINGS (api_key, log_interval) set as they are; a value ServerOptions refuses is
    a usage error naming its flag (--root-path, not root_path)."""
    from minillm.server.app import ServerOptions
    from minillm.server.transport import TransportOptions
    from minillm.tokenizer import chat_template_from_arg
    v = given
    limits = server_limits(
        max_n=v["max_n"], max_prompts_per_request=v["max_prompts_per_request"],
        max_stop_strings=v["max_stop_strings"], max_stop_string_chars=v["max_stop_string_length"],
        max_stop_token_ids=v["max_stop_token_ids"], max_allowed_token_ids=v["max_allowed_token_ids"],
        max_prompt_chars=v["max_prompt_chars"], max_stats_streams=v["max_stats_streams"],
        stream_timeout_s=v["stream_timeout"], header_timeout_s=v["header_timeout"],
        body_timeout_s=v["body_timeout"], timeout_keep_alive_s=v["timeout_keep_alive"])
    cors = {name: json_list_option(v[name], f"--{name.replace('_', '-')}")
            for name in ("allowed_origins", "allowed_methods", "allowed_headers")}
    template = None if v["chat_template"] is None else chat_template_option(v["chat_template"], chat_template_from_arg)
    command = ctx.command_path
    tool_call_parser = auto_tool_parser(v["enable_auto_tool_choice"], v["tool_call_parser"], command)
    # The served name taken from MODEL did not come from --served-model-name.
    with option_values(ctx, unless=() if v["served_model_name"] else ("served_model_name",)):
        transport = TransportOptions(uds=v["uds"], ssl_keyfile=v["ssl_keyfile"], ssl_certfile=v["ssl_certfile"],
                                     ssl_ca_certs=v["ssl_ca_certs"], ssl_cert_reqs=v["ssl_cert_reqs"],
                                     ssl_ciphers=v["ssl_ciphers"], enable_ssl_refresh=v["enable_ssl_refresh"])
        return ServerOptions(
            transport=transport, served_model_name=served_model_name, chat_template=template,
            trust_request_chat_template=v["trust_request_chat_template"], limits=limits,
            log_requests=log_requests_option(v["enable_log_requests"], v["disable_log_requests"]),
            exit_on_engine_error=v["exit_on_engine_error"], timeout_graceful_shutdown=v["timeout_graceful_shutdown"],
            shutdown_timeout=shutdown_timeout_option(ctx, v["shutdown_timeout"], v["timeout_graceful_shutdown"]),
            engine_core=_plain(v["engine_core"]), api_server_count=v["api_server_count"],
            allow_credentials=v["allow_credentials"], response_role=v["response_role"],
            root_path=v["root_path"] or "", enable_docs=not v["disable_fastapi_docs"],
            request_id_headers=v["enable_request_id_headers"],
            chat_template_content_format=_plain(v["chat_template_content_format"]),
            return_tokens_as_token_ids=v["return_tokens_as_token_ids"],
            enable_prompt_tokens_details=v["enable_prompt_tokens_details"],
            enable_force_include_usage=v["enable_force_include_usage"], stream_interval=v["stream_interval"],
            default_chat_template_kwargs=v["default_chat_template_kwargs"],
            enable_server_load_tracking=v["enable_server_load_tracking"],
            reasoning_parser=_plain(v["reasoning_parser"]) if v["reasoning_parser"] else None,
            structured_outputs_config=v["structured_outputs_config"], tool_call_parser=tool_call_parser,
            uvicorn_log_level=_plain(v["uvicorn_log_level"] or UvicornLogLevel.info),
            uvicorn_access_log=not v["disable_uvicorn_access_log"], middleware=tuple(v["middleware"] or ()),
            **cors, **settings)


@app.command(cls=ServeCommand)
@with_engine_options
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        help=f"Model directory or hub id (default: $MINILLM_MODEL or {DEFAULT_CHAT_MODEL}).")] = None,
    model_option: Annotated[Optional[str], typer.Option(
        "--model", metavar="MODEL", help="MODEL given as an option, as vLLM's --model.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind: this machine only by default, where vLLM binds every "
                                           "interface (0.0.0.0: every interface).",
                                      callback=host_option)] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind.")] = 8000,
    uds: Annotated[Optional[str], typer.Option(
        "--uds", metavar="PATH", help="Unix domain socket path. If set, host and port arguments are ignored "
        "(vLLM's --uds); clients reach it as unix:PATH.")] = None,
    ssl_keyfile: Annotated[Optional[str], _server_option(
        "--ssl-keyfile", metavar="FILE", help="The file path to the SSL key file (PEM).")] = None,
    ssl_certfile: Annotated[Optional[str], _server_option(
        "--ssl-certfile", metavar="FILE", help="The file path to the SSL cert file (PEM): the server speaks "
        "HTTPS.")] = None,
    ssl_ca_certs: Annotated[Optional[str], _server_option(
        "--ssl-ca-certs", metavar="FILE", help="The CA certificates file client certificates are checked "
        "against.")] = None,
    ssl_cert_reqs: Annotated[int, _server_option(
        "--ssl-cert-reqs", help="Whether client certificate is required (see stdlib ssl module's): 0 none, "
        "1 optional, 2 required.")] = 0,
    ssl_ciphers: Annotated[Optional[str], _server_option(
        "--ssl-ciphers", metavar="CIPHERS", help="SSL cipher suites for HTTPS (TLS 1.2 and below only), e.g. "
        "'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305'.")] = None,
    enable_ssl_refresh: Annotated[bool, _server_option(
        "--enable-ssl-refresh", help="Refresh SSL Context when SSL certificate files change (new connections "
        "get the new certificate).")] = False,
    api_key: Annotated[Optional[list[str]], typer.Option(
        "--api-key", metavar="KEY...", help="Require a bearer token on /v1: any of several keys, given after one "
        "flag as vLLM takes them (--api-key k1 k2), or a flag each (default: $VLLM_API_KEY, one key, as vLLM reads "
        "it; unset: none).")] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        "--served-model-name", metavar="NAME...",
        help="The names clients use for the model (default: MODEL). Several may follow the option, as in "
             "vLLM: a request may name any of them, responses, /v1/models' first entry and the metrics "
             "carry the first; MODEL goes before the option.")] = None,
    config: Annotated[Optional[str], typer.Option(
        "--config", metavar="YAML", help="Read options from a YAML file, as vLLM's --config: one option a key, "
        "named without its dashes (max-model-len: 32k, enable-prefix-caching: false, served-model-name: [a, b]); "
        "options on the command line win over the file's.")] = None,
    monitor: Annotated[bool, typer.Option(help="Show the live monitor in this terminal.")] = False,
    seed: Annotated[int, typer.Option(
        help="Seeds the seeds of requests that bring none (vLLM's --seed, an integer in [0, 2**32 - 1]): the "
             "same requests in the same order sample alike after a restart.")] = 0,
    chat_template: Annotated[Optional[str], _server_option(
        "--chat-template", help="Chat template for /v1/chat/completions: a file, or the template itself "
        "(default: the model's).")] = None,
    chat_template_content_format: Annotated[ChatTemplateContentFormat, _server_option(
        "--chat-template-content-format", help="How a message's content reaches the chat template (vLLM's "
        "--chat-template-content-format): string (text parts joined by newlines), openai (a list of "
        '{"type": "text", "text": ...} parts), or auto (parts for a template that loops over a message\'s '
        "content, else the string).")] = ChatTemplateContentFormat.auto,
    trust_request_chat_template: Annotated[bool, _server_option(
        "--trust-request-chat-template", help="Render a chat_template sent with a request (it runs "
        "the client's Jinja code on this server).")] = False,
    exit_on_engine_error: Annotated[bool, _server_option(
        "--exit-on-engine-error/--no-exit-on-engine-error", help="Exit with status 1 shortly after the "
        "engine fails, so that a supervisor restarts the server.")] = True,
    timeout_graceful_shutdown: Annotated[float, _server_option(
        "--timeout-graceful-shutdown", help="Seconds a stopping server (SIGTERM, Ctrl-C) gives open requests "
        "to finish; those still open a second before the end get an error event (streams) or a 503.")] = 5.0,
    shutdown_timeout: Annotated[Optional[float], _server_option(
        "--shutdown-timeout", metavar="SECONDS", help="vLLM's name for --timeout-graceful-shutdown, which it "
        "replaces: seconds a stopping server gives open requests; 0 ends them at once with an error event "
        "or a 503 (vLLM's default, an abort).")] = None,
    engine_core: Annotated[EngineCore, _server_option(
        "--engine-core", help="Where the engine core runs: its own process, apart from the HTTP server "
        "(process), or a thread of the server's process (thread).")] = EngineCore.process,
    api_server_count: Annotated[int, _server_option(
        "--api-server-count", "-asc", min=1, help="API server processes sharing the port and the one engine "
        "core (HTTP, detokenising and streaming spread over them; needs --engine-core process).")] = 1,
    allowed_origins: Annotated[str, _server_option(
        "--allowed-origins", metavar="JSON", help='Origins a browser page may call the API from (CORS), as a JSON '
        'list: ["https://app.example"].')] = '["*"]',
    allowed_methods: Annotated[str, _server_option(
        "--allowed-methods", metavar="JSON", help="HTTP methods allowed from other origins, as a JSON list.")] = '["*"]',
    allowed_headers: Annotated[str, _server_option(
        "--allowed-headers", metavar="JSON", help="Request headers allowed from other origins, as a JSON list.")]
        = '["*"]',
    allow_credentials: Annotated[bool, _server_option(
        "--allow-credentials/--no-allow-credentials", help="Let cross-origin requests carry credentials "
        "(cookies, Authorization).")] = False,
    max_n: Annotated[int, _server_option("--max-n", help="Most completions per prompt (n).")] = _limit_default("max_n"),
    max_prompts_per_request: Annotated[int, _server_option(
        "--max-prompts-per-request", help="Most prompts in one request, and most n x prompts.")] = (
        _limit_default("max_prompts_per_request")),
    max_stop_strings: Annotated[int, _server_option(
        "--max-stop-strings", help="Most stop strings in one request.")] = _limit_default("max_stop_strings"),
    max_stop_string_length: Annotated[int, _server_option(
        "--max-stop-string-length", help="Longest stop string, in characters.")] = (
        _limit_default("max_stop_string_chars")),
    max_stop_token_ids: Annotated[int, _server_option(
        "--max-stop-token-ids", help="Most stop_token_ids in one request.")] = _limit_default("max_stop_token_ids"),
    max_allowed_token_ids: Annotated[int, _server_option(
        "--max-allowed-token-ids", help="Most allowed_token_ids in one request, counted once per prompt.")] = (
        _limit_default("max_allowed_token_ids")),
    max_prompt_chars: Annotated[int, _server_option(
        "--max-prompt-chars", help="Most characters of prompt or message text in one request, checked "
        "before tokenising.")] = _limit_default("max_prompt_chars"),
    max_stats_streams: Annotated[int, _server_option(
        "--max-stats-streams", help="Most open /v1/stats/stream connections.")] = _limit_default("max_stats_streams"),
    stream_timeout: Annotated[float, _server_option(
        "--stream-timeout", help="Seconds a stream waits on a client that reads nothing before it is cut "
        "off.")] = _limit_default("stream_timeout_s"),
    header_timeout: Annotated[float, _server_option(
        "--header-timeout", help="Seconds a client has to send a request's headers.")] = (
        _limit_default("header_timeout_s")),
    body_timeout: Annotated[float, _server_option(
        "--body-timeout", help="Seconds a client has to send a request's body.")] = _limit_default("body_timeout_s"),
    timeout_keep_alive: Annotated[float, _server_option(
        "--timeout-keep-alive", help="Seconds an idle keep-alive connection stays open.")] = (
        _limit_default("timeout_keep_alive_s")),
    enable_log_requests: Annotated[bool, _server_option(
        "--enable-log-requests/--no-enable-log-requests", help="Log each request received: its id, sampling "
        "params and prompt length, never its text (vLLM's --enable-log-requests).")] = False,
    disable_log_requests: Annotated[bool, _server_option(
        "--disable-log-requests", help="Log no requests, the default (vLLM's older flag, from when request "
        "logs were on by default).")] = False,
    disable_log_stats: Annotated[bool, _server_option(
        "--disable-log-stats", help="Leave out the throughput line logged every 5 s while requests run "
        "(vLLM's --disable-log-stats); /metrics and /v1/stats still count everything.")] = False,
    middleware: Annotated[Optional[list[str]], _server_option(
        "--middleware", metavar="IMPORT.PATH", callback=middleware_option, help="The operator's ASGI middleware, "
        "as vLLM's --middleware: a class (added by app.add_middleware) or an async function (request, "
        "call_next) (an http middleware), by import path such as mypackage.auth.Check; repeat for several. "
        "It runs first, before the API key check.")] = None,
    uvicorn_log_level: Annotated[Optional[UvicornLogLevel], _server_option(
        "--uvicorn-log-level", help="The HTTP server's log level: its start-up and shutdown lines and "
        "its line per request (vLLM's --uvicorn-log-level; default: info).")] = None,
    disable_uvicorn_access_log: Annotated[bool, _server_option(
        "--disable-uvicorn-access-log", help="No log line per HTTP request (vLLM's "
        "--disable-uvicorn-access-log).")] = False,
    root_path: Annotated[Optional[str], _server_option(
        "--root-path", metavar="PATH", help="The path prefix a proxy serves the API under, e.g. /llm (vLLM's "
        "--root-path): paths are matched with it or without it, and /docs names its URLs under it.")] = None,
    response_role: Annotated[str, _server_option(
        "--response-role", help="A chat reply's role when the request opens a new turn (add_generation_prompt; "
        "else the last message's role), as vLLM's --response-role.")] = "assistant",
    disable_fastapi_docs: Annotated[bool, _server_option(
        "--disable-fastapi-docs", help="Serve no /docs, /redoc and /openapi.json (vLLM's "
        "--disable-fastapi-docs).")] = False,
    enable_request_id_headers: Annotated[bool, _server_option(
        "--enable-request-id-headers", help="Every response carries an X-Request-Id header: the client's own, "
        "else a fresh id (vLLM's --enable-request-id-headers).")] = False,
    return_tokens_as_token_ids: Annotated[bool, _server_option(
        "--return-tokens-as-token-ids/--no-return-tokens-as-token-ids", help="Logprobs name each token "
        '"token_id:<id>" instead of its text, for requests that do not set return_tokens_as_token_ids '
        "themselves (vLLM's --return-tokens-as-token-ids).")] = False,
    enable_prompt_tokens_details: Annotated[bool, _server_option(
        "--enable-prompt-tokens-details/--no-enable-prompt-tokens-details", help="Usage blocks carry "
        "prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache (vLLM's "
        "--enable-prompt-tokens-details).")] = False,
    enable_force_include_usage: Annotated[bool, _server_option(
        "--enable-force-include-usage", help="Every stream ends with a usage chunk, whatever the request's "
        "stream_options say (vLLM's --enable-force-include-usage).")] = False,
    stream_interval: Annotated[int, _server_option(
        "--stream-interval", min=1, metavar="N", help="The interval (or buffer size) for streaming in terms of "
        "token length. A smaller value (1) makes streaming smoother by sending each token immediately, while a "
        "larger value (e.g., 10) reduces host overhead and may increase throughput by batching multiple tokens "
        "before sending (vLLM's --stream-interval; a stream's first and last chunks go at once, and a request's "
        "stream_interval may raise it, never lower it).")] = 1,
    default_chat_template_kwargs: Annotated[Optional[str], _server_option(
        "--default-chat-template-kwargs", metavar="JSON", callback=lambda v: json_object_option(
            v, "--default-chat-template-kwargs"), help='Chat template variables every conversation gets unless '
        'its chat_template_kwargs set them, e.g. \'{"enable_thinking": false}\' (vLLM\'s '
        "--default-chat-template-kwargs).")] = None,
    enable_auto_tool_choice: Annotated[bool, _server_option(
        "--enable-auto-tool-choice", help='Serve tool_choice "auto" (the default when a request gives tools): '
        "the model's own tool calls, found by --tool-call-parser, come back as tool_calls.")] = False,
    tool_call_parser: Annotated[Optional[ToolCallParser], _server_option(
        "--tool-call-parser", help="How the model writes a tool call: hermes (<tool_call> JSON </tool_call>: "
        "Hermes, Qwen 2.5, Qwen3) or llama3_json (JSON objects: Llama 3.1-3.3).")] = None,
    reasoning_parser: Annotated[Optional[ReasoningParserName], _server_option(
        "--reasoning-parser", help="Chat replies carry the model's thinking (<think>...</think>) as "
        "message.reasoning, apart from content: deepseek_r1, or qwen3 (which honours chat_template_kwargs "
        "enable_thinking).")] = None,
    structured_outputs_config: Annotated[Optional[str], _server_option(
        "--structured-outputs-config", metavar="JSON", callback=lambda v: json_object_option(
            v, "--structured-outputs-config"), help='As vLLM takes it: \'{"enable_in_reasoning": true}\' holds '
        "a reasoning model's output to response_format, structured_outputs or a forced tool call from its first "
        "token (by default only what follows </think> is held); backend auto (JSON schemas' objects take only "
        "the keys they list, as under vLLM's default backend) or guidance (JSON Schema's open objects, closed "
        "by its disable_additional_properties true or a request's), reasoning_parser (as --reasoning-parser), "
        "disable_fallback and disable_any_whitespace true are taken too.")] = None,
    enable_server_load_tracking: Annotated[bool, _server_option(
        "--enable-server-load-tracking/--no-enable-server-load-tracking", help="GET /load counts the "
        "completions and chat completions in flight; without it /load answers 0, as vLLM's does.")] = False,
    trust_remote_code: Annotated[bool, _server_option(
        "--trust-remote-code", help="Taken for vLLM command lines, and changes nothing: minillm runs its own "
        "decoder for every model it loads, never code from a checkpoint (one that needs its own code is "
        "refused at load either way).")] = False,
    kv_role: Annotated[Optional[KVRole], typer.Option(
        "--kv-role", rich_help_panel=KV_TRANSFER_PANEL, help="Take part in prefill/decode disaggregation: a "
        "producer (prefill server) leases its prompts' KV to consumers (decode servers); minillm router joins "
        "them.")] = None,
    kv_transfer_config: Annotated[Optional[str], typer.Option(
        "--kv-transfer-config", metavar="JSON", rich_help_panel=KV_TRANSFER_PANEL, help='As vLLM takes it: '
        '{"kv_connector": "PDConnector", "kv_role": "kv_producer", "kv_port": 14579, "kv_buffer_device": "cpu"}.')]
        = None,
    kv_lease_s: Annotated[Optional[float], typer.Option(
        "--kv-lease-s", rich_help_panel=KV_TRANSFER_PANEL, help="Seconds a producer holds a prompt's blocks "
        "that no decode server has released (default 30).")] = None,
    *,
    engine_options: dict,
) -> None:
    """Serve the OpenAI-compatible HTTP API.

    Endpoints: /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens,
    /v1/models, /v1/stats, /v1/stats/stream, /metrics, /health, /ping, /load, /tokenize, /detokenize, /version,
    /invocations.
    """
    given = dict(locals())
    model = model_from_option(model, model_option)
    check_api_servers(api_server_count, engine_core, monitor)
    if monitor and ssl_certfile is not None:
        raise UsageError("--monitor and --ssl-certfile cannot be combined: run `minillm monitor https://HOST:PORT` "
                         "in another terminal (SSL_CERT_FILE names a CA of your own)")
    stream = stream_not_a_terminal() if monitor else None
    if stream is not None:
        raise CliError(f"--monitor draws the dashboard in this terminal, but {stream} is not a terminal (a log "
                       "would get its frames); leave it out, and run `minillm monitor URL` in a terminal")
    log_requests = log_requests_option(enable_log_requests, disable_log_requests)
    if monitor and (log_requests or uvicorn_log_level is not None):
        flag = "--enable-log-requests" if log_requests else "--uvicorn-log-level"
        raise UsageError(f"--monitor draws the dashboard in this terminal, where {flag} would log over it; "
                         "leave one out (and run `minillm monitor URL` in another terminal to have both)")
    names = served_names_option(served_model_name, model, ctx.command_path)
    keys, model = api_keys_option(api_key, model)
    keys = keys if keys is not None else api_key_variable()
    check_model_variable(model)
    name = model or os.environ.get("MINILLM_MODEL") or DEFAULT_CHAT_MODEL
    from minillm.server.app import run_server
    options = server_options(ctx, given, names or name, api_key=keys,
                             log_interval=None if disable_log_stats else 5.0)
    if trust_remote_code:
        typer.echo("minillm: --trust-remote-code changes nothing: minillm runs its own decoder for every model "
                   "it loads, never code from a checkpoint", err=True)
    engine_settings = dict(served_model_name=options.served_model_name[0], seed=seed,
                           kv_transfer_config=kv_transfer_option(kv_role, kv_transfer_config, kv_lease_s))
    if kv_role is not None and kv_transfer_config is None:
        ctx.meta[OPTION_ALIASES] = {"kv_transfer_config": "kv_role"}
    check_engine_options(ctx, model, engine_options, **engine_settings)
    path = resolve_chat_model(model, engine_options["download_dir"], command="serve",
                              revision=engine_options["revision"])
    engine_options = resolve_tokenizer(ctx, name, path, engine_options)
    check_model_tokenizer(path, engine_options, api_server_count)
    config = engine_config(path, engine_options, **engine_settings)
    with option_values(ctx):     # the engine's start-up refusing a value names its flag, as generate's does
        status = run_server(config, host=host, port=port, options=options, monitor=monitor)
    if status:
        raise typer.Exit(status)


def model_from_option(model: str | None, option: str | None, flag: str = "--model") -> str | None:
    """MODEL, from the argument or from vLLM's FLAG (serve's --model, chat's --model-name); two that
    differ are a usage error."""
    if option is None:
        return model
    if model is not None and model != option:
        raise UsageError(f"MODEL {model} and {flag} {option} disagree; give the model once")
    return option


def check_api_servers(count: int, engine_core: EngineCore, monitor: bool) -> None:
    """A usage error naming both flags when several API servers (--api-server-count) meet an option
    that keeps to one: the engine core in the server's thread, or the dashboard of one server's engine."""
    if count > 1 and engine_core is EngineCore.thread:
        raise UsageError(f"--api-server-count {count} and --engine-core thread cannot be combined: several API "
                         "servers share one engine core in its own process (--engine-core process)")
    if count > 1 and monitor:
        raise UsageError(f"--api-server-count {count} and --monitor cannot be combined: the dashboard shows one "
                         "API server's engine (run `minillm monitor URL` in another terminal)")


def api_keys_option(keys: list[str] | None, model: str | None) -> tuple[str | tuple[str, ...] | None, str | None]:
    """(--api-key's keys, MODEL): one key as it is, several as a tuple, None when none was given. The keys
    run up to the next option, as vLLM's: with MODEL left out, a model directory that ends them is MODEL
    written after them (minillm serve --api-key KEY DIR), as after a flag that takes one value."""
    if not keys:
        return None, model
    if model is None and len(keys) > 1 and _is_model_dir(keys[-1]):
        keys, model = keys[:-1], keys[-1]
    return (keys[0] if len(keys) == 1 else tuple(keys)), model


def api_key_variable() -> str | None:
    """$VLLM_API_KEY, the key vLLM's server requires when --api-key is left out (empty: none); one of
    spaces is a CliError, not a key nobody can send."""
    value = os.environ.get("VLLM_API_KEY", "")
    if value and not value.strip():
        raise CliError("$VLLM_API_KEY is blank: set it to the key clients must send, or unset it")
    return value or None


def openai_key_variable() -> str | None:
    """$OPENAI_API_KEY, the key vLLM's chat sends when --api-key is left out (empty: none); one an
    HTTP header cannot carry is a CliError naming the variable."""
    value = os.environ.get("OPENAI_API_KEY") or None
    if value is not None:
        from minillm.urls import authorization_headers
        try:
            authorization_headers(value, "$OPENAI_API_KEY")
        except ValueError as exc:
            raise CliError(str(exc)) from None
    return value


def shutdown_timeout_option(ctx, shutdown_timeout: float | None, timeout_graceful_shutdown: float) -> float | None:
    """vLLM's --shutdown-timeout; a usage error where --timeout-graceful-shutdown is given another value."""
    if shutdown_timeout is not None and shutdown_timeout != timeout_graceful_shutdown and \
            ctx.get_parameter_source("timeout_graceful_shutdown").name == "COMMANDLINE":
        raise UsageError(f"--shutdown-timeout and --timeout-graceful-shutdown disagree ({shutdown_timeout:g} and "
                         f"{timeout_graceful_shutdown:g} seconds); give one")
    return shutdown_timeout


def log_requests_option(enable: bool, disable: bool) -> bool:
    """Whether to log each request, from vLLM's --enable-log-requests and its older --disable-log-requests."""
    if enable and disable:
        raise UsageError("--enable-log-requests and --disable-log-requests disagree; give one")
    return enable


def served_names_option(names: list[str] | None, model: str | None, command: str) -> tuple[str, ...] | None:
    """--served-model-name's names (None: none given). With MODEL left out, a name that is a model
    directory is MODEL written after the option, which took it as a name (as vLLM's does): a CliError
    says so, showing COMMAND (minillm serve, minillm run-batch) with the model first, rather than
    serving the default model under it."""
    if not names:
        return None
    if model is None:
        taken = next((n for n in names if _is_model_dir(n)), None)
        if taken is not None:
            raise CliError(f"--served-model-name took {taken} as a name (its values run up to the next option, "
                           f"as in vLLM); give the model first: {command} {taken} --served-model-name ...")
    return tuple(names)


def _is_model_dir(name: str) -> bool:
    """Whether NAME, read as a path (~ and ~user expanded, an unknown ~user as written), is a model
    directory; a name no path can be (too long, a NUL) is none."""
    return os.path.isfile(expand_user(name) / "config.json")


def kv_transfer_option(role: KVRole | None, config_json: str | None, lease_s: float | None) -> dict | None:
    """The kv_transfer_config of --kv-role, --kv-transfer-config and --kv-lease-s (None: no role)."""
    if role is None and config_json is None:
        if lease_s is not None:
            raise UsageError("--kv-lease-s needs --kv-role or --kv-transfer-config")
        return None
    config: dict = {}
    if config_json is not None:
        try:
            config = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"is not valid JSON: {exc}", param_hint="'--kv-transfer-config'") from None
        if not isinstance(config, dict):
            raise typer.BadParameter("must be a JSON object", param_hint="'--kv-transfer-config'")
    if role is not None:
        kv_role = f"kv_{_plain(role)}"
        if config.get("kv_role", kv_role) != kv_role:
            raise UsageError(f"--kv-role {_plain(role)} and --kv-transfer-config's kv_role {config['kv_role']} "
                             "disagree")
        config["kv_role"] = kv_role
    config.setdefault("kv_connector", "PDConnector")
    if lease_s is not None:
        limit_option("--kv-lease-s", lease_s)
        config["kv_lease_s"] = lease_s
    return config


def seconds_option(value: float) -> float:
    """A timeout in seconds; one that is no positive number (0, -1, nan) is a usage error naming its option."""
    if not value > 0:
        raise typer.BadParameter(f"must be a positive number of seconds, got {value}")
    return value


_NO_HTTP = "run-batch reads its requests from the input file, over no HTTP connection"
_NO_STREAM = 'a batch line cannot stream ("stream": true is its error line)'
# serve's options that make no sense for a batch, and why: run-batch refuses each with its reason.
BATCH_REFUSED_OPTIONS = {
    **dict.fromkeys(("host", "port", "uds"), "run-batch answers the batch in this process and binds no address"),
    **dict.fromkeys(("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers",
                     "enable_ssl_refresh"), f"{_NO_HTTP}, so none takes TLS"),
    "api_key": "run-batch's requests come from its input file, with no client to show a key",
    **dict.fromkeys(("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"),
                    "run-batch answers no browser, so CORS has nothing to allow"),
    "root_path": "run-batch sends each line to its url (/v1/...) itself, behind no proxy",
    "api_server_count": "run-batch runs one API app in this process (--engine-core says where the engine runs)",
    "middleware": f"{_NO_HTTP} for middleware to guard",
    "monitor": "run-batch reports its progress on stderr; the dashboard watches a server",
    "exit_on_engine_error": "run-batch ends with its batch; there is no server for a supervisor to restart",
    **dict.fromkeys(("timeout_graceful_shutdown", "shutdown_timeout"),
                    "run-batch stops once every line is answered; there is no server to shut down"),
    **dict.fromkeys(("header_timeout", "body_timeout", "timeout_keep_alive"), _NO_HTTP),
    **dict.fromkeys(("stream_timeout", "stream_interval", "enable_force_include_usage"), _NO_STREAM),
    "max_stats_streams": "run-batch serves no /v1/stats/stream",
    "disable_log_stats": "run-batch logs no throughput line; its progress goes to stderr a tenth of the batch at a time",
    **dict.fromkeys(("uvicorn_log_level", "disable_uvicorn_access_log"), "run-batch runs no HTTP server to log"),
    "disable_fastapi_docs": "run-batch serves no /docs",
    "enable_request_id_headers": "a batch output line carries no headers (its request_id is its own)",
    "enable_server_load_tracking": "run-batch serves no /load",
    **dict.fromkeys(("kv_role", "kv_transfer_config", "kv_lease_s"),
                    "run-batch takes part in no prefill/decode disaggregation"),
}


def serve_parameters() -> list[inspect.Parameter]:
    """serve's options and MODEL, as its signature declares them."""
    return [p for p in inspect.signature(serve.__wrapped__).parameters.values() if p.name not in ("ctx", "engine_options")]


def option_flags(param: inspect.Parameter) -> list[str]:
    """Every flag of a typer option PARAM (--x and --no-x, short names too); none for an argument."""
    info = param.annotation.__metadata__[0]
    if not isinstance(info, typer.models.OptionInfo):
        return []
    decls = [d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("-")]
    return [flag for decl in decls for flag in decl.split("/") if flag] or [f"--{param.name.replace('_', '-')}"]


@functools.cache
def batch_refused_flags() -> dict[str, str]:
    """{flag: why run-batch refuses it} for every flag of BATCH_REFUSED_OPTIONS."""
    return {flag: BATCH_REFUSED_OPTIONS[p.name] for p in serve_parameters() if p.name in BATCH_REFUSED_OPTIONS
            for flag in option_flags(p)}


def with_serve_options(command: Callable) -> Callable:
    """Add serve's options (and MODEL) but BATCH_REFUSED_OPTIONS to COMMAND's signature, and hand every
    serve option's value to it as `serve_values` (the refused at serve's defaults)."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "serve_values"]
    params = serve_parameters()
    defaults = {p.name: p.default for p in params}
    taken = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params if p.name not in BATCH_REFUSED_OPTIONS]

    @functools.wraps(command)
    def wrapper(**kwargs):
        values = {**defaults, **{p.name: kwargs.pop(p.name) for p in taken}}
        return command(serve_values=values, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + taken)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + taken}
    return wrapper


class RunBatchCommand(ServeCommand):
    spread_options = ("--served-model-name",)

    @property
    def refused_options(self) -> dict[str, str]:
        return batch_refused_flags()


@app.command(name="run-batch", cls=RunBatchCommand)
@with_engine_options
@with_serve_options
def run_batch_command(
    ctx: typer.Context,
    input_file: Annotated[str, typer.Option(
        "--input-file", "-i", metavar="PATH", help="The batch: an OpenAI Batch API JSONL file (a request a line: "
        "custom_id, method POST, url /v1/chat/completions or /v1/completions, body), a local path, an http(s) "
        "URL, or - for stdin.")],
    output_file: Annotated[str, typer.Option(
        "--output-file", "-o", metavar="PATH", help="Where the answers go, a line each in input order: a local "
        "path, an http(s) URL the file is PUT to, or - for stdout.")],
    output_tmp_dir: Annotated[Optional[str], typer.Option(
        "--output-tmp-dir", metavar="DIR", help="Where the output is written before it is uploaded to an "
        "--output-file URL (default: the system's temporary directory).")] = None,
    *,
    serve_values: dict,
    engine_options: dict,
) -> None:
    """Run an OpenAI batch file through the server's API offline, as vLLM's run-batch.

    Each line is validated and answered exactly as `minillm serve` answers it, with the same options that
    shape an answer (parsers, templates, limits, --config); a line that cannot be run (not JSON, a missing
    field, another url, a 400) gets its own error line and the batch goes on.
    """
    from minillm import run_batch
    v = serve_values
    model = model_from_option(v["model"], v["model_option"])
    files = run_batch.BatchFiles(input_file, output_file, output_tmp_dir)
    try:
        run_batch.check_output(files)
        lines = run_batch.read_input(input_file)
    except ValueError as exc:
        flag, _, reason = str(exc).partition(" ")
        raise typer.BadParameter(reason, param_hint=f"'{flag}'") from None
    names = served_names_option(v["served_model_name"], model, ctx.command_path)
    check_model_variable(model)
    name = model or os.environ.get("MINILLM_MODEL") or DEFAULT_CHAT_MODEL
    options = server_options(ctx, v, names or name, log_interval=None)
    if v["trust_remote_code"]:
        typer.echo("minillm: --trust-remote-code changes nothing: minillm runs its own decoder for every model "
                   "it loads, never code from a checkpoint", err=True)
    settings = dict(served_model_name=options.served_model_name[0], seed=v["seed"])
    check_engine_options(ctx, model, engine_options, **settings)
    path = resolve_chat_model(model, engine_options["download_dir"], command="run-batch",
                              revision=engine_options["revision"])
    engine_options = resolve_tokenizer(ctx, name, path, engine_options)
    with option_values(ctx):
        summary = run_batch_engine(engine_config(path, engine_options, **settings), options.engine_core,
                                   options, lines, files)
    typer.echo(run_batch.describe_summary(summary, output_file), err=True)


def run_batch_engine(config: EngineConfig, engine_core: str, options, lines: list[str], files):
    """Start the server's engine for CONFIG, run the batch's lines through its app, and stop it."""
    from minillm.engine_stats import describe_engine
    from minillm.run_batch import write_outputs
    from minillm.server.async_engine import start_async_engine
    engine = start_async_engine(config, engine_core)
    try:
        typer.echo(describe_engine(engine.startup_stats), err=True)
        return write_outputs(engine, options, lines, files)
    finally:
        engine.shutdown()


class RouterCommand(SpreadValuesCommand):
    spread_options = ("--api-key",)


@app.command(name="router", cls=RouterCommand)
def router_command(
    prefill: Annotated[list[str], typer.Option(
        "--prefill", help="A prefill server (minillm serve --kv-role producer); repeat for several.")],
    decode: Annotated[list[str], typer.Option(
        "--decode", help="A decode server (minillm serve --kv-role consumer); repeat for several.")],
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface).",
                                      callback=host_option)] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind.")] = 8000,
    connect_timeout: Annotated[float, typer.Option(
        callback=seconds_option, help="Seconds to wait for a server to accept a connection before trying the next.")]
        = 3.0,
    timeout: Annotated[float, typer.Option(callback=seconds_option, help="Seconds a server may take to answer.")]
        = 600.0,
    api_key: Annotated[Optional[list[str]], typer.Option(
        "--api-key", metavar="KEY...", help="Require a bearer token on the router's /v1 routes, as serve's --api-key "
        "(any of several keys: --api-key k1 k2); the client's key goes on to the servers, which may require one "
        "too.  [default: none]", show_default=False)] = None,
) -> None:
    """An OpenAI-compatible proxy for prefill/decode disaggregation.

    Each request is prefilled on a prefill server (one token, its KV leased), then sent with the
    returned kv_transfer_params to a decode server, whose stream is passed through.
    """
    from minillm.router import RouterConfig, run_router
    for option, urls in (("--prefill", prefill), ("--decode", decode)):
        for url in urls:
            server_url_option(url, option)
    try:
        config = RouterConfig(tuple(prefill), tuple(decode), connect_timeout, timeout, api_keys=tuple(api_key or ()))
    except ValueError as exc:          # a blank key
        raise typer.BadParameter(str(exc), param_hint="'--api-key'") from None
    check_can_bind(host, port)
    run_router(config, host=host, port=port)


@app.command(name="monitor", cls=MinillmCommand)
def monitor_command(
    url: Annotated[Optional[str], typer.Argument(
        help="The server to watch.  [default: http://127.0.0.1:8000]", show_default=False)] = None,
    url_option: Annotated[Optional[str], typer.Option(
        "--url", help="The server to watch, named as chat --url names it.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="API key of the server (default: $OPENAI_API_KEY, as chat --url takes it).")] = None,
    record: Annotated[Optional[Path], typer.Option(   # written, not read: click's readable check is off
        readable=False, help="Save the stats stream to FILE (.gz: compressed).")] = None,
    replay: Annotated[Optional[Path], typer.Option(help="Replay a recorded FILE instead of watching a server.")] = None,
    demo: Annotated[bool, typer.Option(
        "--demo", help="Replay the recording shipped with minillm (a loaded stories260K server): a look "
                       "at the monitor without running a server.")] = False,
    interval: Annotated[Optional[float], typer.Option(
        metavar="SECONDS", callback=lambda v: None if v is None else monitor_interval_option(v),
        help="Seconds between the server's snapshots, 0.1 to 60 (the bounds its /v1/stats/stream takes). A "
             "stream open but without a snapshot for 3 intervals (10 s at least, the interval + 30 s at most), "
             "or without its first for 3 s, is polled at /v1/stats instead, the title saying so (the banner, "
             "where that fails too), and "
             "asked for again after a doubling wait.  [default: 0.25]", show_default=False)] = None,
) -> None:
    """Watch a server's KV cache and scheduler live.

    No server at hand? minillm monitor --demo replays the recording shipped with minillm; it
    loops, and the title marks each new pass. Press ? inside for what each panel shows.
    """
    from minillm.tui.app import demo_recording, run_monitor
    from minillm.urls import shown_url
    if demo and replay:      # two options that cannot be combined: a usage error, as everywhere else
        raise UsageError("--demo and --replay cannot be combined: give either --demo or --replay FILE")
    if interval is not None and (demo or replay):
        raise UsageError(f"--interval and {'--demo' if demo else '--replay'} cannot be combined: a recording "
                         "plays at the pace it was recorded")
    if url is not None and url_option is not None:
        raise UsageError("the server is named twice (URL and --url): give one")
    if demo or replay is not None:   # a recording is watched instead of a server: naming one would be passed over
        # --api-key "" (a script's unset variable) is no key, as the monitor's client reads it
        server = next((f for f, v in (("URL", url), ("--url", url_option), ("--api-key", api_key or None))
                       if v is not None), None)
        if server is not None:
            raise UsageError(f"{server} and {'--demo' if demo else '--replay'} cannot be combined: a recording is "
                             "played instead of watching a server (give one or the other)")
    url_flag = "URL" if url_option is None else "--url"
    url = next((u for u in (url, url_option) if u is not None), "http://127.0.0.1:8000")
    source = None
    if demo or replay is not None:
        source = open_recording("--demo" if demo else "--replay", demo_recording() if demo else replay)
    if record is not None and replay is not None and record.resolve() == replay.resolve():
        raise CliError(f"--record {record} is the --replay file: recording would overwrite it")
    base_url = None
    if source is None:
        base_url = server_url_option(url, url_flag)
        api_key_option(api_key)
        if api_key is None:
            api_key = openai_key_variable()
    if record is not None:
        check_record_path(record)
    stream = stream_not_a_terminal()
    if stream is not None:
        # Textual would draw frame after frame into the file or pipe, and never end.
        # the server's address as the monitor reaches it (http:// added, /v1 and a password left out)
        where = "" if base_url is None else \
            f", or read one snapshot of the stats as JSON from {shown_url(base_url)}/v1/stats"
        raise CliError(f"the monitor draws its dashboard in a terminal, but {stream} is not one (a file or a pipe "
                       f"would get frames without end); run it in a terminal{where}")
    status = run_monitor(url, api_key=api_key, source=source, recorder=open_recorder(record) if record else None,
                         interval_s=interval)
    if status:
        raise typer.Exit(status)      # 130 (Ctrl-C): main() says "interrupted"


def monitor_interval_option(value: float) -> float:
    """monitor's --interval; one the server's stats stream refuses (or nan, inf) is a usage error
    naming the option, not a 400 shown in the dashboard's banner at every retry."""
    from minillm.tui.client import MAX_INTERVAL_S, MIN_INTERVAL_S
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise typer.BadParameter(f"must be {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} seconds, got {value:g}")
    return value


def stream_not_a_terminal() -> str | None:
    """"stdout" or "stderr", the first of them that is not a terminal, or None: the dashboard is
    drawn on stderr (Textual's output) and keeps a redirected stdout empty, so it needs both."""
    from minillm.chat_terminal import is_terminal
    return next((name for name in ("stdout", "stderr") if not is_terminal(getattr(sys, name))), None)


def server_url_option(url: str, option: str) -> str:
    """The server's base URL; one no client can connect to (a port past 65535, an open bracket, an empty
    one) is a usage error naming OPTION (--url, or the URL argument)."""
    from minillm.urls import check_server_url
    try:
        return check_server_url(url, option)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{option}: "), param_hint=f"'{option}'") from None


def api_key_option(api_key: str | None) -> None:
    """A usage error naming --api-key for a key an HTTP header cannot carry (a line break, spaces at its ends)."""
    from minillm.urls import authorization_headers
    try:
        authorization_headers(api_key, "--api-key")
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--api-key "), param_hint="'--api-key'") from None


def check_can_bind(host: str, port: int) -> None:
    """A CliError when host:port cannot be listened on (an unknown host, a port in use)."""
    from minillm.server.app import check_can_listen
    try:
        check_can_listen(host, port)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None


def open_recording(option: str, path: Path):
    """The ReplaySource of a recording; a path that is no readable recording is a CliError naming OPTION."""
    from minillm.tui.recording import ReplaySource
    if path.is_dir():
        raise CliError(f"{option} {path} is a directory, not a recording")
    if not path.is_file():
        raise CliError(f"{option}: no such recording: {path}")
    try:
        return ReplaySource(path)
    except ValueError as exc:        # its message names the file, and the line where there is one
        raise CliError(f"{option}: {_one_line(exc)}") from None
    except OSError as exc:
        raise CliError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None


def check_record_path(path: Path) -> None:
    """The CliError open_recorder would raise for PATH, found without truncating a file that is there
    (nor leaving one behind that was not)."""
    if path.is_dir():
        raise CliError(f"--record {path} is a directory: give a file to write the recording to")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise CliError(f"--record: cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def open_recorder(path: Path):
    """A Recorder writing to PATH; one that cannot be created is a CliError naming --record."""
    from minillm.tui.recording import Recorder
    if path.is_dir():
        raise CliError(f"--record {path} is a directory: give a file to write the recording to")
    try:
        return Recorder(path)
    except OSError as exc:
        raise CliError(f"--record: cannot write {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------------------------
# pull, list
# ---------------------------------------------------------------------------------------------

@app.command(cls=MinillmCommand)
def pull(
    model: Annotated[str, typer.Argument(help="Hub id, e.g. Qwen/Qwen3-0.6B.")],
    download_dir: Annotated[Optional[str], typer.Option(
        callback=download_dir_option, help=f"Where hub models are stored ({STORE_DEFAULT}).")] = None,
    revision: Annotated[Optional[str], typer.Option(
        callback=revision_option, help="A branch, tag or commit (default: main).")] = None,
) -> None:
    """Download a model from the Hugging Face Hub into the model store (or bring it up to date)."""
    from minillm.model_store import check_store, download_model, is_repo_id, no_such_directory
    check_model_name(model)
    check_download_dir(download_dir)
    check_store(download_dir)
    if expand_user(model).is_dir():
        raise CliError(f"{model} is a local directory: there is nothing to pull; use it as it is "
                       f"(minillm chat {model})")
    if not is_repo_id(model) or model.startswith((".", "/", "~")):
        raise CliError(f"{no_such_directory(model)}; pull takes a Hugging Face repo id such as {DEFAULT_CHAT_MODEL}")
    path = download_model(model, download_dir, revision, could_be_path=False)
    typer.echo(f"pulled {model} into {path}")


@app.command(name="list", cls=MinillmCommand)
def list_command(
    download_dir: Annotated[Optional[str], typer.Option(
        callback=download_dir_option, help=f"Where hub models are stored ({STORE_DEFAULT}).")] = None,
) -> None:
    """List the models in the store (downloads by minillm, transformers, vLLM, huggingface-cli)."""
    from minillm.engine_stats import human_bytes
    from minillm.model_store import check_store, list_local_models, model_store
    require_stdout("list")
    check_download_dir(download_dir)
    check_store(download_dir)
    models = list_local_models(download_dir)
    if not models:
        typer.echo(f"no models in {model_store(download_dir)} (minillm pull MODEL fetches one)")
        return
    width = max(len("NAME"), *(len(m.repo_id) for m in models))
    typer.echo(f"{'NAME':<{width}}  {'SIZE':>10}  PATH")
    for m in models:
        note = f"  (minillm cannot run it: {m.note})" if m.note else ""
        typer.echo(f"{m.repo_id:<{width}}  {human_bytes(m.size_bytes):>10}  {m.path}{note}")


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
                "help_option_names": []}


def run_benchmark(name: str, argv: list[str]) -> None:
    """minillm.benchmarks.<name>.main(argv): a bad argument or a benchmark that cannot run is one line."""
    from minillm.benchmarks.cli_args import BenchError, BenchUsageError
    require_stdout(f"bench {name}")     # print() to a closed stdout drops the results table without a word
    module = importlib.import_module(f"minillm.benchmarks.{name}")
    try:
        status = module.main(list(argv))
    except BenchUsageError as exc:
        raise typer.Exit(_fail(f"{exc.prog}: error: {exc.message} (try '{exc.prog} --help')", 2)) from None
    except BenchError as exc:
        raise typer.Exit(_fail(f"minillm bench {name}: error: {exc}", 1)) from None
    if isinstance(status, int) and status:
        raise typer.Exit(status)


def _bench_command(name: str, summary: str, alias: str | None = None) -> None:
    def command(args: Annotated[Optional[list[str]], typer.Argument(
            help=f"Options of minillm bench {name} (--help lists them with their defaults).")] = None) -> None:
        run_benchmark(name, args or [])
    command.__doc__ = summary
    bench_app.command(name=name, context_settings=PASS_THROUGH, add_help_option=False)(command)
    if alias is not None:      # vLLM's name for the same benchmark, left out of the list
        bench_app.command(name=alias, context_settings=PASS_THROUGH, add_help_option=False, hidden=True)(command)


_bench_command("throughput", "Offline throughput: a batch of prompts through the engine.")
_bench_command("latency", "Latency of one fixed batch through the engine, as vllm bench latency measures it.")
_bench_command("serving", "Online serving: requests at a rate against a running server.", alias="serve")
_bench_command("kernels", "Kernel micro-benchmarks against their roofline.")
_bench_command("pd_disagg", "Prefill/decode disaggregation on one GPU against one server with chunked prefill.")
_bench_command("serving_gaps", "Where a serving run's long inter-token gaps sit (a bench serving --save-detailed file).")


# ---------------------------------------------------------------------------------------------
# help
# ---------------------------------------------------------------------------------------------

@app.command(name="help", cls=MinillmCommand)
def help_command(
    ctx: typer.Context,
    command: Annotated[Optional[list[str]], typer.Argument(
        help="The command (and bench's subcommand) to explain; none: every command.", show_default=False)] = None,
) -> None:
    """Show a command's help, as COMMAND --help does (minillm help generate)."""
    words = list(command or [])
    group = ctx.parent.command
    for i, word in enumerate(words):
        commands = getattr(group, "commands", None)
        if commands is None:
            raise UsageError(f"'minillm {' '.join(words[:i])}' has no subcommand '{word}'.")
        if word not in commands:
            raise UsageError(f"No such command '{' '.join(words[:i + 1])}'.")
        group = commands[word]
    app(args=[*words, "--help"], prog_name="minillm", standalone_mode=False)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """The command line (minillm/entry.py runs it): one line on stderr and a non-zero status for any user error."""
    try:
        status = app(args=argv, prog_name="minillm", standalone_mode=False)
        if status == 130:     # typer turns Ctrl-C inside a command into status 130 and says nothing
            status = _fail("minillm: interrupted", 130)
    except UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":   # a bare `minillm` or `minillm bench`
            print(exc.format_message())
            sys.exit(0)
        command_hint = other_tool_command(exc)
        if command_hint is not None:
            exc.message = f"{exc.message.rstrip('.')}: {command_hint}"
        if type(exc).__name__ == "NoSuchOption" and exc.ctx is not None:
            exc.possibilities = close_options(exc.option_name, exc.ctx)
            reason = vllm_flag_reason(exc.option_name, exc.ctx)
            if reason is not None:         # a vLLM flag: why minillm has none, not the names it is close to
                exc.message, exc.possibilities = f"{exc.message}: {reason}", None
        # click's parser leaves out the context of an option missing its value: the words name the command
        where = exc.ctx.command_path if exc.ctx else command_path(sys.argv[1:] if argv is None else argv)
        # typer checks a choice through pydantic, whose message opens "Value error, 'bf16' is not one of ..."
        message = exc.format_message().replace("': Value error, ", "': ", 1)
        status = _fail(f"{where}: error: {message} (try '{where} --help')", exc.exit_code)
    except ClickException as exc:
        status = _fail(f"minillm: error: {exc.format_message()}", exc.exit_code)
    except typer.Abort:
        status = _fail("minillm: aborted", 130)
    except KeyboardInterrupt:
        status = _fail("minillm: interrupted", 130)
    except MemoryError as exc:      # e.g. --max-num-seqs far past what the host can hold
        status = _fail(f"minillm: error: out of memory: {_one_line(exc)}", 1)
    except (CliError, ValueError, RuntimeError, OSError, ImportError) as exc:
        status = _fail(f"minillm: error: {_one_line(exc)}", 1)
    if status == 130 and argv is None:
        # The process winds down (a KV pool to free, threads to join): another Ctrl-C in that time
        # ends it at once, by the signal, where Python would print a traceback of its shutdown.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(status if isinstance(status, int) else 0)


_NO_LORA = "minillm loads no LoRA adapters"
# vLLM's flags that minillm has no counterpart for, and why: an unknown option's error says it.
VLLM_FLAGS_NOT_TAKEN = {
    **dict.fromkeys(("--quantization", "-q"), "minillm runs unquantized weights only (fp32, fp16, bf16)"),
    **dict.fromkeys(("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"), _NO_LORA),
    **dict.fromkeys(("--pipeline-parallel-size", "-pp"), "minillm splits a model over processes by "
                    "--tensor-parallel-size only"),
    **dict.fromkeys(("--data-parallel-size", "-dp"), "minillm serves one engine (--api-server-count spreads "
                    "the HTTP work over processes)"),
    "--max-log-len": "--enable-log-requests logs no prompt text, so there is none to cut",
    "--config": "minillm serve reads a YAML file of options; this command takes them from the command line only",
    "--disable-frontend-multiprocessing": "minillm's counterpart is --engine-core thread",
    "--cpu-offload-gb": "minillm keeps every weight on the device",
    "--swap-space": "a preempted request is recomputed, never swapped out",
    **dict.fromkeys(("--task", "--runner"), "minillm generates text only; leave the option out"),
    "--guided-decoding-backend": "structured outputs always use llguidance",
    "--disable-sliding-window": "minillm always does that: a sliding-window model's context is held to its "
                                "window; leave the option out",
    "--limit-mm-per-prompt": "minillm serves text-only models",
    "--hf-overrides": "minillm reads config.json as it is",
    "--distributed-executor-backend": "tensor-parallel ranks are processes on this host",
    "--enable-metrics": "run-batch serves no /metrics endpoint; minillm serve does, always",
}


# vLLM's and Ollama's commands that minillm has under another name (or not): an unknown command's error says so.
OTHER_TOOLS_COMMANDS = {
    "run": "Ollama's run is minillm chat MODEL (-q MESSAGE for one reply)",
    "complete": "vLLM's complete is minillm generate MODEL -p TEXT offline, or minillm chat --url URL -q TEXT "
                "against a server (a model without a chat template continues the text)",
}


def other_tool_command(exc) -> str | None:
    """Which minillm command does what vLLM's or Ollama's command does, for click's 'No such command' error."""
    match = re.fullmatch(r"No such command '([^']+)'\.?", getattr(exc, "message", "") or "")
    return None if match is None else OTHER_TOOLS_COMMANDS.get(match[1])


def vllm_flag_reason(name: str, ctx) -> str | None:
    """Why minillm has no counterpart of vLLM's flag NAME, where it says so in words of ctx's command (a
    reason that points at another command's options is left out). vLLM's dotted form of a JSON flag
    (--hf-overrides.max_position_embeddings) is that flag."""
    name = name.partition(".")[0].replace("_", "-")
    refused = getattr(ctx.command, "refused_options", {}).get(name)
    if refused is not None:
        return refused
    reason = VLLM_FLAGS_NOT_TAKEN.get(name)
    if reason is None:
        return None
    options = {o for p in ctx.command.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}
    return reason if set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", reason)) <= options else None


def close_options(name: str, ctx) -> list[str]:
    """The options of ctx's command a mistyped NAME likely meant, those it abbreviates first (click
    offers only the closest spelled: --temp got --help, --stop and -tp, not --temperature)."""
    from minillm.benchmarks.cli_args import close_option_names
    return close_option_names(name, [o for p in ctx.command.get_params(ctx) if p.param_type_name == "option"
                                     for o in (*p.opts, *p.secondary_opts)])


def command_path(args: list[str]) -> str:
    """The command ARGS run, as click names it: "minillm bench serving" for bench serving --num-prompts."""
    import typer.main
    command, words = typer.main.get_command(app), ["minillm"]
    for arg in args:
        command = getattr(command, "commands", {}).get(arg)
        if command is None:
            break
        words.append(arg)
    return " ".join(words)


def _one_line(exc: BaseException) -> str:
    """The exception's message flattened onto one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def _fail(message: str, status: int) -> int:
    """Print the error line, its control characters escaped on a terminal (a model id a server lists
    may hold an ESC), and return the exit status."""
    print(terminal_safe(message) if is_terminal(sys.stderr) else message, file=sys.stderr)
    return status
