"""Text <-> token ids: a Hugging Face tokenizer.json, its special tokens and its chat template."""
from __future__ import annotations

import functools
import inspect
import json
import logging
import numbers
import stat
from pathlib import Path
from typing import Any

import tokenizers

from minillm.generation_config import sampling_defaults, token_id_list
from minillm.model_store import expand_user, read_json_object, resolve_tokenizer_path
from minillm.sampling_params import short_repr

logger = logging.getLogger("minillm")

# What a lossy UTF-8 decode puts where bytes do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"

# vLLM's logprobs read a token whose text ends inside a character with at most this many tokens before it
# (a UTF-8 character has at most four bytes).
MAX_LOGPROB_CONTEXT_TOKENS = 4

# Token ids above this are decoded each time, not remembered (no vocabulary is near it; ids a
# client sends are checked against the vocabulary, but nothing here relies on that).
MAX_CACHED_TOKEN_ID = 1 << 20

# Names of special tokens a tokenizer_config.json may define, as transformers passes them to templates.
# Chat content part types read as text, as vLLM reads them, and the key that holds the text (a
# "thinking" part's text is content, not reasoning, as in vLLM's chat_utils); a message's text parts
# are joined by newlines (PART_SEPARATOR) into the string a template reads.
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
PART_SEPARATOR = "\n"
# vLLM's chat_template_content_format: a message's content handed to the template as one string,
# as a list of text parts ("openai"), or as the template reads it ("auto").
CONTENT_FORMATS = ("auto", "string", "openai")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the order of all_special_tokens
_SPECIAL_TOKENS_ORDER = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' PreTrainedTokenizerBase default for model_max_length when the config gives none
VERY_LARGE_INTEGER = int(1e30)
# Where transformers' save_pretrained writes a tokenizer's templates other than the default, one NAME.jinja each.
ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"
# The longest chat template file read: the template sandbox's bound on a string (a pipe may never end).
MAX_TEMPLATE_CHARS = 1 << 24
# transformers' apply_chat_template arguments that shape the tokenized output (tensors, padding,
# truncation, masks), which minillm's lists of ids do not have: taken only at their off values.
_TOKENIZE_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                     "tokenizer_kwargs")


def check_content_format(value) -> str:
    """value if it is one of CONTENT_FORMATS; ValueError naming chat_template_content_format otherwise."""
    if not isinstance(value, str) or value not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be {', '.join(map(repr, CONTENT_FORMATS[:-1]))} "
                         f"or {CONTENT_FORMATS[-1]!r}, got {short_repr(value)}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it (a string or an AddedToken dict) -> its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_token_list(value: Any, where: str) -> list[str | None]:
    """An additional_special_tokens field (a list of strings or AddedToken dicts) -> their texts;
    ValueError naming WHERE for anything else (a string was read character by character, each
    character then a special token that decoding dropped from every output)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, (str, dict)) for t in value):
        raise ValueError(f"{where} must be a list of tokens (strings or {{\"content\": ...}} objects), "
                         f"got {short_repr(value)}")
    return [_token_content(t) for t in value]


def _dedup(ids: list[int]) -> list[int]:
    """ids without repeats, first occurrence kept."""
    return list(dict.fromkeys(ids))


def load_chat_template(path: Path, tokenizer_config: dict) -> tuple[str | dict | None, dict[str, str]]:
    """The chat template of a model directory, or its named templates, as transformers reads them: the
    files transformers' save_pretrained writes (chat_template.jinja, the default, and
    additional_chat_templates/NAME.jinja) win over tokenizer_config.json's, all of them. With it,
    where each template was read (template name -> a file, or a file's field), "default" for one."""
    files = _template_files(path)
    if files:
        sources = {name: text for name, (text, _) in files.items()}
        where = {name: str(file) for name, (_, file) in files.items()}
        return (sources["default"] if list(files) == ["default"] else sources), where
    source = path / "tokenizer_config.json"
    template = tokenizer_config.get("chat_template")
    if template is None:
        source = path / "chat_template.json"
        template = read_json_object(source, missing_ok=True).get("chat_template")
    field = f"{source} field 'chat_template'"
    if isinstance(template, list):
        # A list of named templates: [{"name": "default", "template": "..."}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise ValueError(f"{field} must be a template or a list of "
                             f"{{\"name\": ..., \"template\": ...}} objects, got {short_repr(template)}")
        return ({t["name"]: t["template"] for t in template},
                {t["name"]: f"{field}, the template named {t['name']!r}" for t in template})
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{field} must be a template (a string) or a list of "
                         f"{{\"name\": ..., \"template\": ...}} objects, got {short_repr(template)}")
    return template, ({"default": field} if template is not None else {})


def _template_files(path: Path) -> dict[str, tuple[str, Path]]:
    """Template name -> (source, file) of the template files in a model directory ("default" for
    chat_template.jinja)."""
    files = {}
    if (path / "chat_template.jinja").is_file():
        files["default"] = (_template_text(path / "chat_template.jinja"), path / "chat_template.jinja")
    folder = path / ADDITIONAL_TEMPLATES_DIR
    if folder.is_dir():
        for file in sorted(folder.glob("*.jinja")):
            if file.is_file():
                files[file.name.removesuffix(".jinja")] = (_template_text(file), file)
    return files


def _template_text(file: Path) -> str:
    """A model's template file's text; a ValueError naming the file when it is not UTF-8 (the
    decoder's message alone named no file)."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template file {file} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def compile_error(exc: Exception, where: str = "") -> str:
    """Why a chat template does not compile: the error's type and message, with WHERE the template
    was read and the template's line when Jinja names one."""
    line = getattr(exc, "lineno", None)
    at = " of ".join(part for part in (f"line {line}" if line else "", where) if part)
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}{f' at {at}' if at else ''}: {message}"


def _check_model_vocabulary(backend: tokenizers.Tokenizer, vocab_size, path: Path, model_path: Path) -> None:
    """ValueError naming config.json's vocab_size when the tokenizer has ids past it: the model has no
    embedding row for them, and a text holding one failed inside the engine (transformers' forward
    pass raises IndexError on it); naming tokenizer when it was given apart from the model (MODEL_PATH).
    A vocab_size that is no positive integer is the loader's to refuse."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        return
    top = max(backend.get_vocab_size(with_added_tokens=False) - 1, *backend.get_added_tokens_decoder(), -1)
    if top < vocab_size:
        return
    has_ids = f"has token ids up to {top} ({backend.id_to_token(top)!r})"
    if path != model_path:
        raise ValueError(f"tokenizer {path} {has_ids}, past the model's vocabulary ({model_path / 'config.json'} "
                         f"field 'vocab_size' is {vocab_size}): the model has no embedding for ids from "
                         f"{vocab_size} on")
    raise ValueError(f"{path / 'config.json'} field 'vocab_size' is {vocab_size}, but {path / 'tokenizer.json'} "
                     f"{has_ids}: the model has no embedding for ids from {vocab_size} on")


def drop_whole_text_word_cache(backend: tokenizers.Tokenizer) -> bool:
    """Turn off the BPE word cache of a tokenizer that has no pre-tokenizer; True when it did."""
    # Without a pre-tokenizer (SentencePiece BPE as converted for Llama 2, Mistral, stories260K) the
    # whole text between special tokens is one "word": the cache keeps each distinct prompt of up to
    # 256 bytes (up to 8 KiB an entry), 10,000 of them per encoding thread (measured with tokenizers
    # 0.23: 4 threads held 40,000, about 70 MiB for 40-character prompts), and a hit saves nothing
    # measurable (46.5 us against 46.6 for a 170-character prompt).
    resize = getattr(backend.model, "_resize_cache", None)      # tokenizers 0.21 on; older ones keep theirs
    if backend.pre_tokenizer is not None or not isinstance(backend.model, tokenizers.models.BPE) or resize is None:
        return False
    resize(0)
    return True


def read_generation_config(file: Path) -> dict:
    """The model's generation_config.json ({} when it has none). One that is not valid JSON (or not
    UTF-8) is left out with a warning naming it, as transformers and vLLM load the model without it;
    valid JSON that is no object is a ValueError naming it, as transformers fails on it too."""
    if not file.is_file():
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:      # not JSON, or not UTF-8
        logger.warning("%s is not valid JSON (%s); the model is loaded without it: no sampling defaults or "
                       "end-of-turn ids from it", file, exc)
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def no_tokenizer_json(path: Path) -> str:
    """Why a model directory without tokenizer.json cannot be read, and how to give it one."""
    if not (path / "tokenizer.model").is_file():
        return f"{path} has no tokenizer.json (only fast Hugging Face tokenizers are supported)"
    return (f"{path} has tokenizer.model (a SentencePiece tokenizer) but no tokenizer.json, the fast tokenizer "
            f"minillm reads; transformers (with sentencepiece) writes one beside it: python -c \"from transformers "
            f"import AutoTokenizer; AutoTokenizer.from_pretrained({str(path)!r}).save_pretrained({str(path)!r})\"")


def engine_tokenizer(config, model_path: Path, renders_chat: bool = True) -> Tokenizer:
    """The tokenizer of an engine of CONFIG (an EngineConfig) whose model is at MODEL_PATH: the files of
    config.tokenizer at tokenizer_revision (vLLM's), else the model's own."""
    source = model_path
    if config.tokenizer is not None or config.tokenizer_revision is not None:
        source = resolve_tokenizer_path(config.tokenizer or config.model, config.download_dir,
                                        config.tokenizer_revision, config.revision)
    return Tokenizer.from_pretrained(source, renders_chat, model_path=model_path)


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template itself, taken as given (vLLM's
    --chat-template), compiled once here so a broken one fails at start-up."""
    source = template_file_text(value)
    is_inline = source is None
    if is_inline:
        if "{" not in value:
            raise ValueError(f"chat template file not found: {value} (give a file, or the template itself)")
        source = value
    try:
        compile_chat_template(source)
    except Exception as e:   # jinja2's TemplateSyntaxError and friends
        where = "" if is_inline else f" in {value}"
        raise ValueError(f"chat template{where} does not compile: {type(e).__name__}: {e}") from None
    return source


def template_file_text(value: str) -> str | None:
    """The text of the chat template file VALUE names, a pipe too (bash's `<(...)`, which vLLM reads as a
    file); None when it names nothing; a ValueError naming --chat-template for a device or such (/dev/null),
    a file that is empty or not UTF-8, or one past MAX_TEMPLATE_CHARS."""
    path = expand_user(value)
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):     # no such file, or a template's text too long (or odd) to be a name
        return None
    if stat.S_ISDIR(mode):
        return None                   # the callers name a directory themselves
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise ValueError(f"--chat-template {value!r} is not a regular file; give the template's file, "
                         f"or the template itself")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_TEMPLATE_CHARS + 1)
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"--chat-template: {value} holds more than {MAX_TEMPLATE_CHARS} characters")
    if not text.strip():
        raise ValueError(f"--chat-template: {value} is empty")
    return text


def compile_chat_template(source: str):
    """A Jinja template compiled in the bounded sandbox with the helpers Hugging Face chat templates
    expect (minillm/chat_template.py)."""
    from minillm.chat_template import compile_chat_template as compile_bounded
    return compile_bounded(source)


class BatchEncoding(dict):
    """What calling the tokenizer returns, as transformers' BatchEncoding: {"input_ids", "attention_mask"}
    read by key or as attributes (tokenizer(text).input_ids)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"'BatchEncoding' object has no attribute {name!r} (it holds "
                                 f"{', '.join(map(repr, self))})") from None


class Tokenizer:
    """A tokenizers.Tokenizer plus the special ids and chat template a model directory declares."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str] | None = None,
                 extra_eos_token_ids: list[int] | None = None, pad_token_id: int | None = None,
                 chat_template: str | dict | None = None, name: str = "") -> None:
        self.backend = backend
        self.name = name
        # The sampling defaults the model's generation_config.json recommends (minillm/generation_config.py).
        self.generation_defaults: dict = {}
        self.special_tokens = dict(special_tokens or {})   # e.g. {"bos_token": "<s>", ...}
        self.bos_token_id = self._id_of("bos_token")
        eos = self._id_of("eos_token")
        self.eos_token_ids: list[int] = _dedup(([eos] if eos is not None else []) + list(extra_eos_token_ids or []))
        self.pad_token_id = self._id_of("pad_token")
        if self.pad_token_id is None:
            self.pad_token_id = pad_token_id
        self.unk_token_id = self._id_of("unk_token")
        self.chat_template = chat_template
        # Where each of the model's templates was read (name -> file or field), for errors that name it.
        self.template_origins: dict[str, str] = {}
        self._compiled_template = None
        # transformers' names read from tokenizer_config.json (from_pretrained sets them)
        self.additional_special_tokens: list[str] = []
        self.model_max_length = VERY_LARGE_INTEGER
        self.padding_side = self.truncation_side = "right"     # transformers' defaults; minillm pads nothing
        # transformers' clean_up_tokenization_spaces (tokenizer_config.json's, False without it): decode's default
        self.clean_up_tokenization_spaces = False
        # transformers' clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output
        self.cleans_up_bpe = False
        # (token id, skip_special_tokens) -> the token's text decoded alone (a streaming detokenizer
        # asks for the same few thousand again and again).
        self._token_texts: dict[tuple[int, bool], str] = {}
        self._logprob_texts: dict[int, str] = {}    # token id -> logprob_token_text without context

    def _id_of(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    @classmethod
    def from_pretrained(cls, path: str | Path, renders_chat: bool = True,
                        model_path: str | Path | None = None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat templates from PATH, and config.json and
        generation_config.json from MODEL_PATH (default: PATH), as vLLM reads a --tokenizer apart from
        the model; renders_chat False for a process that never renders a chat (an engine core beside
        its API servers, which warn of a template that does not compile)."""
        path = Path(path)
        model_path = path if model_path is None else Path(model_path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(no_tokenizer_json(path) if path == model_path else f"tokenizer {no_tokenizer_json(path)}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:   # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{tokenizer_file} is not a tokenizer the tokenizers library can read: {exc}") from None
        drop_whole_text_word_cache(backend)
        tokenizer_config = read_json_object(path / "tokenizer_config.json", missing_ok=True)
        special_map = read_json_object(path / "special_tokens_map.json", missing_ok=True)
        generation_config = read_generation_config(model_path / "generation_config.json")
        model_config = read_json_object(model_path / "config.json", missing_ok=True)

        special_tokens = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(tokenizer_config.get(name, special_map.get(name)))
            if content is not None:
                special_tokens[name] = content
        extra_file = "tokenizer_config.json" if tokenizer_config.get("additional_special_tokens") \
            else "special_tokens_map.json"
        extra = _special_token_list((tokenizer_config.get("additional_special_tokens")
                                     or special_map.get("additional_special_tokens")),
                                    f"{path / extra_file} field 'additional_special_tokens'")
        _apply_added_tokens_decoder(backend, tokenizer_config.get("added_tokens_decoder"),
                                    set(special_tokens.values()))
        _register_special_tokens(backend, list(special_tokens.values()) + extra)
        # transformers' split_special_tokens: special tokens' texts in a text are encoded as text (chat
        # templates' output too), never as the special ids.
        if tokenizer_config.get("split_special_tokens") is True:
            backend.encode_special_tokens = True

        # generation_config.json names every id that ends a turn (Llama 3 lists several). config.json's
        # eos_token_id counts where that file is missing (as vLLM reads EOS: transformers'
        # GenerationConfig falls back to config.json only then), or where nothing else names an EOS.
        extra_eos = token_id_list(generation_config.get("eos_token_id"),
                                  f"{model_path / 'generation_config.json'} field 'eos_token_id'")
        if not (model_path / "generation_config.json").is_file() \
                or (not extra_eos and "eos_token" not in special_tokens):
            extra_eos += token_id_list(model_config.get("eos_token_id"),
                                       f"{model_path / 'config.json'} field 'eos_token_id'")
        pad = generation_config.get("pad_token_id")
        _check_model_vocabulary(backend, model_config.get("vocab_size"), path, model_path)
        chat_template, template_origins = load_chat_template(path, tokenizer_config)
        tokenizer = cls(backend, special_tokens, extra_eos, pad if isinstance(pad, int) else None,
                        chat_template, name=str(path))
        tokenizer.template_origins = template_origins
        if renders_chat:
            tokenizer.warn_of_broken_templates()
        tokenizer.generation_defaults = sampling_defaults(generation_config)
        tokenizer.additional_special_tokens = [t for t in extra if t is not None]
        max_length = tokenizer_config.get("model_max_length")
        if isinstance(max_length, (int, float)) and not isinstance(max_length, bool) and max_length > 0:
            tokenizer.model_max_length = int(max_length)
        tokenizer.clean_up_tokenization_spaces = tokenizer_config.get("clean_up_tokenization_spaces") is True
        tokenizer.cleans_up_bpe = tokenizer_config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") is True
        for side in ("padding_side", "truncation_side"):
            if tokenizer_config.get(side) in ("left", "right"):
                setattr(tokenizer, side, tokenizer_config[side])
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, added tokens left out (Hugging Face's vocab_size; len() counts them)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (len() of a Hugging Face tokenizer)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The id of the tokenizer's own eos_token, as Hugging Face's (eos_token_ids also lists the
        generation config's)."""
        return self._id_of("eos_token")

    @property
    def eos_token(self) -> str | None:
        """The eos_token's text (None when the tokenizer names none)."""
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        """The bos_token's text (None when the tokenizer names none)."""
        return self.special_tokens.get("bos_token")

    @functools.cached_property
    def continuation_byte_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens <0x80>..<0xBF>: bytes that continue a character."""
        return self._byte_token_ids(0x80, 0xC0)

    @functools.cached_property
    def added_token_contents(self) -> dict[int, str]:
        """Id -> text of every added token, special or not (what vLLM's spaces_between_special_tokens=False
        writes bare)."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    def _byte_token_ids(self, low: int, high: int) -> frozenset[int]:
        ids = (self.backend.token_to_id(f"<0x{b:02X}>") for b in range(low, high))
        return frozenset(i for i in ids if i is not None)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id over the whole vocabulary, added tokens included (Hugging Face's get_vocab)."""
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list:
        """An id -> its vocabulary string (None outside the vocabulary); a list of ids -> a list, special
        tokens left out when skip_special_tokens, as Hugging Face's."""
        if isinstance(ids, numbers.Integral):
            return self.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.id_to_token(i) for i in ids if i not in skipped]

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of all_special_tokens, as Hugging Face's: the named special tokens and
        additional_special_tokens, not every added token marked special (those skip_special_tokens
        drops in decode, as Hugging Face's decode drops them)."""
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True, **options) -> list[int]:
        """text -> token ids; add_special_tokens adds BOS/EOS as the tokenizer's post-processor says.
        transformers' tokenization options (padding, truncation, ...) are taken only when off."""
        if options:
            _check_options_off("encode", options, _TOKENIZE_OPTIONS)
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:        # "TextInputSequence must be str", of a str with a lone surrogate
            check_unicode(text, "text")
            raise

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **options) -> BatchEncoding:
        """Hugging Face's call: {"input_ids", "attention_mask"} for a text, or lists of them for a list of
        texts, readable as attributes too; transformers' tokenization options (padding, truncation, ...)
        are taken only when off."""
        if options:
            _check_options_off("calling the tokenizer", options, _TOKENIZE_OPTIONS)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        if not isinstance(text, (list, tuple)):
            raise ValueError(f"text must be a str or a list of them, got {type(text).__name__}")
        ids = self.encode_batch(list(text), add_special_tokens)
        return BatchEncoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])

    encode_plus = __call__          # transformers' older names for the call
    batch_encode_plus = __call__

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False, **options) -> list[str]:
        """decode() of each id list (Hugging Face's batch_decode, special tokens kept unless skipped)."""
        try:
            return [self.decode(ids, skip_special_tokens=skip_special_tokens, **options) for ids in sequences]
        except IdOutOfRange as exc:
            raise IdOutOfRange(f"batch_decode{str(exc).removeprefix('decode')}") from None

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **options) -> str:
        """token ids (or one id) -> text, special tokens kept unless skip_special_tokens, as Hugging
        Face's decode (ids the tokenizer does not know decode to nothing); clean_up_tokenization_spaces
        (None: the tokenizer_config.json's) drops the spaces before punctuation and contractions as
        transformers' does, which leaves a BPE tokenizer's text alone (unless its config forces it)."""
        if options:
            # transformers' fast tokenizers read no spaces_between_special_tokens (the decoder decides): either value
            if isinstance(options.get("spaces_between_special_tokens"), bool):
                options = {k: v for k, v in options.items() if k != "spaces_between_special_tokens"}
            _check_options_off("decode", options, ())
        text = self.decode_raw(token_ids, skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces and self._cleans_up else text

    @functools.cached_property
    def _cleans_up(self) -> bool:
        """Whether clean_up_tokenization_spaces changes this tokenizer's text (transformers skips a BPE model's)."""
        return not isinstance(self.backend.model, tokenizers.models.BPE) or self.cleans_up_bpe

    def decode_raw(self, token_ids: int | list[int], skip_special_tokens: bool) -> str:
        """The tokenizer.json decoder's text of token ids, as vLLM's streaming detokenizer reads it."""
        ids = token_ids
        if type(ids) is not list:
            ids = [ids] if isinstance(ids, numbers.Integral) else list(ids)
        try:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:    # the tokenizers library's ids are unsigned 32-bit integers
            bad = next((i for i in ids if not 0 <= i < 1 << 32), ids)
            raise IdOutOfRange(f"decode: token ids must be integers in [0, 2**32), got {bad}") from None

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), remembered (at most one entry per id of the vocabulary and flag)."""
        key = (token_id, skip_special_tokens)
        text = self._token_texts.get(key)
        if text is None:
            text = self.decode_raw([token_id], skip_special_tokens)
            if 0 <= token_id < MAX_CACHED_TOKEN_ID:
                self._token_texts[key] = text
        return text

    def logprob_token_text(self, token_id: int, context: list[int] | tuple[int, ...] = ()) -> str:
        """A token's text as vLLM's logprobs name it (Logprob.decoded_token): decoded alone, specials kept,
        the leading spaces a SentencePiece (Metaspace) decoder strips from a token alone put back; one whose
        bytes end inside a character is read after CONTEXT (the sequence's tokens before it, the last
        MAX_LOGPROB_CONTEXT_TOKENS used): the text it completes, "" while the character is unfinished."""
        text = self._logprob_texts.get(token_id)
        if text is None:
            text = self.decode_token(token_id, skip_special_tokens=False)
            marker = self._leading_space_marker
            if marker is not None and 0 <= token_id < len(self):
                piece = self.backend.id_to_token(int(token_id)) or ""
                missing = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            if 0 <= token_id < MAX_CACHED_TOKEN_ID:
                self._logprob_texts[token_id] = text
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        return self._completed_text(token_id, list(context[-MAX_LOGPROB_CONTEXT_TOKENS:]))

    def _completed_text(self, token_id: int, context: list[int]) -> str:
        """vLLM's reading of a token that ends inside a character: decoded after the fewest of CONTEXT's
        last tokens that complete it, less the text of the context tokens that came before the character
        began (those whose own text ends broken are its first bytes, and named "" themselves)."""
        for num_context in range(1, len(context) + 1):
            before = context[-num_context:]
            whole = self.decode(before + [token_id])
            if whole.endswith(REPLACEMENT_CHAR):
                continue
            clean = len(before)
            while clean > 0 and self.decode_token(before[clean - 1], skip_special_tokens=False).endswith(
                    REPLACEMENT_CHAR):
                clean -= 1
            head = self.decode(before[:clean]) if clean else ""
            same = next((i for i, (a, b) in enumerate(zip(head, whole)) if a != b), min(len(head), len(whole)))
            return whole[same:]
        return ""

    @functools.cached_property
    def _leading_space_marker(self) -> str | None:
        """The replacement character of a Metaspace pre-tokenizer (SentencePiece's "▁"), alone or in a
        sequence: the one whose leading run decode() strips from a token alone. None for others.

        A legacy Llama tokenizer.json (Llama 2, stories260K) spells the same scheme as a normalizer that
        prepends the marker and turns spaces into it, with no pre-tokenizer: transformers (5 on) loads such
        a tokenizer with a Metaspace pre-tokenizer, so vLLM gives its "▁saw" back its space as well."""
        for part in _parts(self.backend.pre_tokenizer, "pretokenizers"):
            if part.get("type") == "Metaspace":
                return part.get("replacement", "\u2581")
        parts = _parts(self.backend.normalizer, "normalizers")
        prepend = next((p.get("prepend") for p in parts if p.get("type") == "Prepend"), None)
        spaces = [p.get("content") for p in parts if p.get("type") == "Replace" and p.get("pattern") == {"String": " "}]
        if prepend and prepend in spaces:
            return prepend
        return None

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list:
        """A token string -> its id (the unk token's id, else None, for one the vocabulary lacks); a
        list -> a list, as Hugging Face's."""
        if isinstance(tokens, str):
            token_id = self.backend.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """text -> its token strings (Hugging Face's tokenize: no special tokens unless asked)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        check_unicode(text, "text")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Token strings -> text through the tokenizer.json decoder, as Hugging Face's fast tokenizers."""
        decoder = self.backend.decoder
        return "".join(tokens) if decoder is None else decoder.decode(list(tokens))

    @property
    def unk_token(self) -> str | None:
        """The unk_token's text (None when the tokenizer names none)."""
        return self.special_tokens.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        """The pad_token's text (None when the tokenizer names none)."""
        return self.special_tokens.get("pad_token")

    @pad_token.setter
    def pad_token(self, value: str | None) -> None:
        """Name a pad token (tok.pad_token = tok.eos_token, as with Hugging Face's); generation reads none."""
        if value is not None and not isinstance(value, str):
            raise ValueError(f"pad_token must be a string or None, got {short_repr(value)}")
        self.special_tokens["pad_token"] = value
        self.pad_token_id = None if value is None else self.backend.token_to_id(value)

    @property
    def max_token_id(self) -> int:
        """The largest token id the tokenizer knows, added tokens included (vLLM's tokenizer attribute)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values())

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        """Special tokens encode() adds to a text (or to a pair of texts), as Hugging Face's."""
        return self.backend.num_special_tokens_to_add(bool(pair))

    @property
    def special_tokens_map(self) -> dict:
        """The named special tokens' texts, and additional_special_tokens when any, as Hugging Face's."""
        named = {k: v for k, v in self.special_tokens.items() if v is not None}
        return {**named, "additional_special_tokens": list(self.additional_special_tokens)} \
            if self.additional_special_tokens else named

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens' texts (in transformers' order) then additional_special_tokens',
        each once, as Hugging Face's."""
        named = [self.special_tokens[n] for n in _SPECIAL_TOKENS_ORDER if self.special_tokens.get(n) is not None]
        return list(dict.fromkeys(named + self.additional_special_tokens))

    @property
    def added_tokens_decoder(self) -> dict:
        """Id -> AddedToken of every added token (Hugging Face's added_tokens_decoder)."""
        return self.backend.get_added_tokens_decoder()

    def get_added_vocab(self) -> dict[str, int]:
        """The added tokens' texts -> ids (Hugging Face's get_added_vocab)."""
        return {tok.content: i for i, tok in sorted(self.added_tokens_decoder.items())}

    @property
    def vocab(self) -> dict[str, int]:
        """get_vocab(), as Hugging Face's vocab property."""
        return self.get_vocab()

    @property
    def name_or_path(self) -> str:
        """The model directory the tokenizer was read from (Hugging Face's name_or_path)."""
        return self.name

    is_fast = True       # a tokenizers (Rust) tokenizer, as transformers' fast ones

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (None when out of range)."""
        return self.backend.id_to_token(int(token_id)) if 0 <= token_id < len(self) else None

    @property
    def has_chat_template(self) -> bool:
        """Whether the model directory carries a chat template."""
        return bool(self.chat_template)

    def template_source(self, name: str | None = None, tools: object = None) -> str:
        """The model's chat template to render with, checked to compile: the one called `name` when
        the model has several, else "tool_use" when tools are given and there is one, else
        "default" (transformers' get_chat_template)."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer of {self.name or 'this model'} has no chat template; "
                             "send a plain prompt instead of chat messages")
        source, chosen = self.chat_template, "default"
        if isinstance(source, dict):
            if name is not None and name in source:
                chosen = name
            elif tools is not None and "tool_use" in source:
                chosen = "tool_use"
            elif "default" not in source:
                raise ValueError(f"the tokenizer of {self.name or 'this model'} has several chat templates "
                                 f"and none named 'default': {sorted(source)}")
            source = source[chosen]
        try:
            compile_chat_template(source)
        except Exception as e:   # jinja2's TemplateSyntaxError and friends
            raise ValueError(f"the chat template of {self.name or 'this model'} does not compile: "
                             f"{compile_error(e, self.template_origins.get(chosen, ''))}") from None
        return source

    def warn_of_broken_templates(self) -> None:
        """Log, once at load, each of the model's chat templates that does not compile, naming its
        file and line: chat requests that use it fail, completions work (as vLLM warns when its
        start-up render of the template fails, and serves on)."""
        templates = self.chat_template if isinstance(self.chat_template, dict) else {"default": self.chat_template}
        for name, source in templates.items():
            if not source:
                continue
            try:
                compile_chat_template(source)
            except Exception as e:   # jinja2's TemplateSyntaxError and friends
                logger.warning("the chat template of %s does not compile: %s; chat requests %s fail, completions "
                               "work", self.name or "this model", compile_error(e, self.template_origins.get(name, "")),
                               "with it" if isinstance(self.chat_template, dict) else "will")

    def render_chat(self, messages: list[dict], template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, content_parts: bool | str = False, **kwargs) -> str:
        """Render messages with `template` (Jinja source, or the name of one of the model's
        templates), or with the model's chat template when None, as transformers renders them.

        continue_final_message (vLLM's and transformers' name): the text ends inside the last
        message, so that the model continues it; it excludes add_generation_prompt. content_parts:
        the messages are an OpenAI request's (content a string, None or a list of text parts
        {"type": "text", "text": ...}), shaped as vLLM shapes them for the template: parts kept when
        the template loops over a message's content, else joined by newlines. It may also name
        vLLM's chat_template_content_format: "auto" (as True), "openai" (parts) or "string" (joined)."""
        from minillm.chat_template import render, shape_content
        source = self._chat_source(template, kwargs.get("tools"))
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{i}] must be a dict with a 'role'")
            _check_content_unicode(message.get("content"), f"messages[{i}]['content']")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        # Keys set to None are dropped, as transformers drops them: templates test for a missing key.
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if content_parts:
            plain = shape_content(plain, _content_as_parts(source, content_parts))
        try:
            text = render(source, plain, add_generation_prompt, continue_final_message, {**self.special_tokens, **kwargs})
        except MemoryError:
            raise ValueError("chat template failed: it ran out of memory") from None
        except Exception as e:   # a template's raise_exception() or a bad message shape
            raise ValueError(f"chat template failed: {e or type(e).__name__}") from e
        # A template may write a lone surrogate ('\ud800', '%c' | format(55296)), which no tokenizer takes.
        check_unicode(text, "chat template failed: the rendered prompt")
        return text

    def content_as_parts(self, template: str | None = None, content_format: bool | str = "auto",
                         tools: object = None) -> bool:
        """Whether render_chat hands an OpenAI message's content to `template` (as render_chat takes it)
        as a list of text parts rather than one string: vLLM's chat_template_content_format "openai",
        or "auto" (True) for a template that loops over a message's content."""
        return _content_as_parts(self._chat_source(template, tools), content_format)

    def _chat_source(self, template: str | None, tools: object) -> str:
        """The Jinja source render_chat renders `template` with, checked to compile."""
        if template is None or (isinstance(self.chat_template, dict) and template in self.chat_template):
            return self.template_source(template, tools)
        _compile_cached(template)
        return template

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, return_dict: bool = False,
                            **template_kwargs) -> str | list[int] | dict | list:
        """Render a conversation (transformers' name; or a batch of them, one result each) with the model's
        chat template, or CHAT_TEMPLATE (a template's source) when given, with the defaults of the
        transformers that vLLM's get_tokenizer() hands out: token ids (no specials added; {"input_ids",
        "attention_mask"} with return_dict) unless tokenize=False, and no generation prompt unless asked
        for. transformers' tokenization options (_TOKENIZE_OPTIONS) are a ValueError naming them unless
        off, never template variables."""
        options = {name: template_kwargs.pop(name) for name in _TOKENIZE_OPTIONS if name in template_kwargs}
        if options:
            _check_options_off("apply_chat_template", options, _TOKENIZE_OPTIONS)
        is_batch = isinstance(conversation, (list, tuple)) and bool(conversation) and \
            isinstance(conversation[0], (list, tuple))
        if template_kwargs.get("tools") is not None:
            template_kwargs["tools"] = tool_schemas(template_kwargs["tools"])
        texts = [self.render_chat(messages, chat_template or None, add_generation_prompt, **template_kwargs)
                 for messages in (conversation if is_batch else [conversation])]
        if not tokenize:
            return texts if is_batch else texts[0]
        # The template writes BOS itself where the model wants it.
        if return_dict:
            return self(texts if is_batch else texts[0], add_special_tokens=False)
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        return ids if is_batch else ids[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts -> their token ids; unlike encode, the work runs without holding the GIL."""
        if any(not isinstance(t, str) for t in texts):
            raise ValueError("texts must be strings")
        try:
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        except TypeError:        # a text with a lone surrogate
            for i, text in enumerate(texts):
                check_unicode(text, f"text[{i}]")
            raise


def tool_schemas(tools) -> list[dict]:
    """apply_chat_template's tools as transformers takes them: JSON schema dicts as they are, Python
    functions (type hints and a Google-style docstring) turned into their schemas by transformers'
    get_json_schema; a ValueError naming tools for anything else."""
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of JSON schemas (dicts) or functions, got {short_repr(tools)}")
    schemas = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict):
            schemas.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            schemas.append(_function_schema(tool, f"tools[{i}]"))
        else:
            raise ValueError(f"tools[{i}] must be a JSON schema (a dict) or a function, got {short_repr(tool)}")
    return schemas


def _function_schema(function, where: str) -> dict:
    """transformers' JSON schema of a Python function offered as a tool."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ValueError(f"{where} is a function: turning it into a JSON schema needs transformers installed; "
                         f"give its JSON schema instead") from None
    try:
        return get_json_schema(function)
    except Exception as exc:    # transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"{where}: {exc}") from None


def _parts(component, key: str) -> list[dict]:
    """A tokenizer.json pre-tokenizer's or normalizer's settings as dicts: itself, then the members of a
    Sequence (KEY: "pretokenizers" or "normalizers"); [] for none."""
    if component is None:
        return []
    try:
        state = json.loads(component.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return []
    if not isinstance(state, dict):
        return []
    return [part for part in [state] + list(state.get(key) or []) if isinstance(part, dict)]


class IdOutOfRange(ValueError):
    """A token id no tokenizer has (the tokenizers library's ids are unsigned 32-bit)."""


def _check_options_off(where: str, options: dict, known: tuple[str, ...]) -> None:
    """ValueError naming a transformers option that is on (minillm's tokenizer has none of them);
    TypeError, as Python's own, for a name transformers does not have either."""
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"{where}: unexpected keyword argument {name!r}")
        if value not in (None, False) and value != {}:
            raise ValueError(f"{where}: {name}={short_repr(value)} is not supported (minillm's tokenizer returns "
                             f"plain lists of token ids and the tokenizer.json decoder's text)")


def clean_up_tokenization(text: str) -> str:
    """text without the spaces a WordPiece tokenizer leaves before punctuation and contractions
    (transformers' clean_up_tokenization)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _check_content_unicode(content, what: str) -> None:
    """ValueError naming a message's content (what) when its text, or a text part's, holds a lone surrogate."""
    if isinstance(content, str):
        check_unicode(content, what)
    elif isinstance(content, (list, tuple)):
        for j, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                check_unicode(part["text"], f"{what}[{j}]['text']")


def check_unicode(text: str, what: str) -> None:
    """ValueError naming `what` when text holds a lone surrogate (Python strings may, and no
    tokenizer takes one); plain ASCII is checked without encoding."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate at index {exc.start}") from None


def _content_as_parts(source: str, content_format: bool | str) -> bool:
    """Whether a template's source gets message content as a list of parts under a content format."""
    if content_format == "openai":
        return True
    if content_format not in (True, "auto"):
        return False
    from minillm.chat_template import reads_content_parts
    return reads_content_parts(source)


def _compile_cached(source: str):
    """compile_chat_template of a request's template, its errors as ValueError."""
    if not isinstance(source, str) or not source:
        raise ValueError("a chat template must be a non-empty string")
    try:
        return compile_chat_template(source)    # cached in chat_template
    except Exception as e:   # jinja2.TemplateSyntaxError and friends
        raise ValueError(f"chat template does not compile: {e}") from e


def chat_template_from_arg(value: str) -> str:
    """A --chat-template value: the path of a file holding the template, or the template itself, taken as
    given (vLLM's load_chat_template reads no escapes in it: a backslash and an n stay two characters)."""
    source = template_file_text(value)
    if source is not None:
        return source
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no such file")
    return value


# The flags of an AddedToken as tokenizer_config.json's added_tokens_decoder writes them.
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(entry) -> tokenizers.AddedToken | None:
    """An added_tokens_decoder entry ({"content": ..., "special": ..., ...}) as an AddedToken; None for
    an entry of no such shape."""
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
        return None
    flags = {k: entry[k] for k in _ADDED_TOKEN_FLAGS if isinstance(entry.get(k), bool)}
    return tokenizers.AddedToken(entry["content"], **flags)


def _apply_added_tokens_decoder(backend: tokenizers.Tokenizer, decoder, named: set[str]) -> None:
    """tokenizer_config.json's added_tokens_decoder over tokenizer.json's added tokens, as transformers
    applies it: a token whose flags there differ from tokenizer.json's (special, so decode skips it;
    lstrip/rstrip, so encode eats the spaces beside it), or a vocabulary token listed there, is added
    again with them (a named special token stays special). Tokens the tokenizer lacks are left out:
    the model has no embedding for the ids they would get."""
    if not isinstance(decoder, dict):
        return
    current = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    tokens = []
    for entry in decoder.values():
        token = _added_token(entry)
        if token is None or backend.token_to_id(token.content) is None or repr(token) in current:
            continue
        if token.content in named and not token.special:
            token = _added_token({**entry, "special": True})
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _register_special_tokens(backend: tokenizers.Tokenizer, contents: list[str | None]) -> None:
    """Mark the named special tokens special in backend, so decode can skip them (as transformers does)."""
    known = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    missing = [c for c in dict.fromkeys(contents) if c and c not in known and backend.token_to_id(c) is not None]
    if missing:
        backend.add_special_tokens([tokenizers.AddedToken(c, special=True, normalized=False) for c in missing])


# Prompt tokens decoded with the output, so that its first word spaces right (sentencepiece's
# leading space), and how many more the window backs over so as not to start inside a character
# whose bytes are tokens of their own (a byte-fallback decoder turns a run of byte tokens that
# starts with a continuation byte into U+FFFD, byte for byte, the output's bytes included).
PROMPT_CONTEXT_TOKENS = 5
MAX_CONTINUATION_TOKENS = 3


def context_start(tok: Tokenizer, ids: list[int]) -> int:
    """Where the decode window over a prompt's ids starts: PROMPT_CONTEXT_TOKENS from the end, or a
    few further back where that cuts a character."""
    start = max(len(ids) - PROMPT_CONTEXT_TOKENS, 0)
    floor = max(start - MAX_CONTINUATION_TOKENS, 0)
    continuation = tok.continuation_byte_ids
    while start > floor and ids[start] in continuation:
        start -= 1
    return start


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting a multi-byte character.

    Each step decodes only the window ids[prefix_offset:]: prefix_offset..read_offset is text already
    emitted (decoded again so that decoder rules that look at a neighbour, such as the leading-space
    strip of sentencepiece, apply the same way); what it adds past that is the new delta.
    """

    # A character in progress spans at most 4 bytes, so a window still broken after this many
    # tokens holds garbage: look for a cut that later tokens cannot change.
    MAX_HELD_TOKENS = 6
    # Past this, runaway garbage is released as is, to keep each step cheap.
    MAX_HELD_TOKENS_HARD = 64

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None, spaces_between_special_tokens: bool = True) -> None:
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # vLLM's spaces_between_special_tokens=False (with special tokens kept): an added token right after
        # another reads as its bare text, without the space a decoder (WordPiece's) joins tokens with.
        self._bare_added = None if skip_special_tokens or spaces_between_special_tokens else \
            (tok.added_token_contents or None)
        self._is_last_added = False
        prompt = list(prompt_token_ids or [])
        self._ids: list[int] = prompt
        self._num_prompt = len(prompt)
        # A few prompt tokens give the first generated token its left context (its leading space).
        self._prefix_offset = context_start(tok, prompt) if prompt else 0
        self._read_offset = len(prompt)
        self._prefix_chars: int | None = None   # len(decode(ids[prefix_offset:read_offset])) once known
        self._is_cut: bool | None = None         # the prompt's ids end inside a character, once known
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """The ids added so far (the prompt excluded)."""
        return self._ids[self._num_prompt:]

    def _decode(self, start: int, end: int) -> str:
        return self.tok.decode_raw(self._ids[start:end], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (may be "" while a character is unfinished)."""
        self._ids.append(int(token_id))
        end = len(self._ids)
        prefix_len = self._prefix_len()
        new_text = self._decode(self._prefix_offset, end)
        if new_text.endswith(REPLACEMENT_CHAR):
            if end - self._read_offset <= self.MAX_HELD_TOKENS:
                return ""
            end, new_text = self._garbage_cut(prefix_len, new_text)
        elif self._read_offset == self._num_prompt > 0 and self._is_prompt_cut():
            prefix_len = self._completed_prompt_character(new_text, prefix_len)
        delta = self._emit(prefix_len, new_text, end)
        return delta if self._bare_added is None else self._unspaced(int(token_id), delta)

    def _unspaced(self, token_id: int, delta: str) -> str:
        """delta as spaces_between_special_tokens=False has it: an added token's bare text when the token
        before it was an added token too."""
        content = self._bare_added.get(token_id)
        if content is not None and self._is_last_added and delta:
            self.text = self.text[:len(self.text) - len(delta)] + content
            delta = content
        self._is_last_added = content is not None
        return delta

    def _is_prompt_cut(self) -> bool:
        """Whether the prompt's ids end inside a character (their window decodes to a trailing U+FFFD):
        byte-fallback <0xNN> tokens, or a byte-level BPE token holding a character's first bytes.
        Decoded once."""
        if self._is_cut is None:
            self._is_cut = self._decode(self._prefix_offset, self._read_offset).endswith(REPLACEMENT_CHAR)
        return self._is_cut

    def _completed_prompt_character(self, window_text: str, prefix_len: int) -> int:
        """The emitted prefix's length once the output's first text completes a character that the
        prompt's last tokens began (a prompt of token ids cut inside a character): read_offset moves
        back to the token where that character starts, for it to be the output's text rather than
        lost (as vLLM's DecodeStream, primed with the prompt, emits it with the output)."""
        floor = max(self._read_offset - MAX_CONTINUATION_TOKENS, self._prefix_offset)
        for start in range(self._read_offset - 1, floor - 1, -1):
            head = self._decode(self._prefix_offset, start)
            if head.endswith(REPLACEMENT_CHAR) or not window_text.startswith(head):
                continue
            if window_text[len(head):].startswith(REPLACEMENT_CHAR):
                break    # bytes no later byte completes: they stay the prompt's
            self._read_offset, self._prefix_chars = start, len(head)
            return len(head)
        return prefix_len

    def _prefix_len(self) -> int:
        """Characters of the text already emitted as the window decodes it: decode(ids[prefix:read]),
        kept until the offsets move. While every token completes text that window is the last
        token alone, whose text the tokenizer remembers: one decode a token instead of two."""
        if self._prefix_chars is None:
            if self._read_offset - self._prefix_offset == 1:
                text = self.tok.decode_token(self._ids[self._prefix_offset], self.skip_special_tokens)
            else:
                text = self._decode(self._prefix_offset, self._read_offset)
            self._prefix_chars = len(text)
        return self._prefix_chars

    def _garbage_cut(self, prefix_len: int, window_text: str) -> tuple[int, str]:
        """(end, text) to release from a window that keeps ending broken; end == read_offset holds all."""
        end = len(self._ids)
        for cut in range(end - 1, self._read_offset, -1):
            left, right = self._decode(self._prefix_offset, cut), self._decode(cut, end)
            # Decoding the two sides apart gives the same text only where the UTF-8 decoder restarts
            # (a non-empty right side has bytes of its own): nothing later can reach back across it.
            if len(left) > prefix_len and right and left + right == window_text:
                return cut, left
        if end - self._read_offset > self.MAX_HELD_TOKENS_HARD:
            return end, window_text
        return self._read_offset, ""

    def _emit(self, prefix_len: int, new_text: str, end: int) -> str:
        if len(new_text) <= prefix_len:
            # Nothing visible yet (e.g. a skipped special token): keep the window so context stays.
            return ""
        delta = new_text[prefix_len:]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_chars = None
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is still held back (call once the stream has ended)."""
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        window = self._decode(self._prefix_offset, end)
        if not window.startswith(self._decode(self._prefix_offset, self._read_offset)):
            # A byte-fallback decoder replaces every byte of a run that ends broken, the emitted
            # character before the held bytes included: the held tokens are decoded alone.
            return self._emit(0, self._decode(self._read_offset, end), end)
        return self._emit(self._prefix_len(), window, end)
