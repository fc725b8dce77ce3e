"""Tokenizers of real model families (byte-level BPE as GPT-2 / Qwen2 / Llama 3 build theirs, SentencePiece-style
BPE with byte fallback as Llama 2 / Mistral) built with the tokenizers library, checked against transformers'
tokenizer on the same files and against vLLM's streaming detokenizer (tokenizers' DecodeStream primed with the
prompt's tail)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.\n",
    "def main():\n    return 42\r\n",
    "日本語のテキストと中文文本，还有한국어 텍스트。\n",
    "emoji 👩‍👩‍👧‍👦 and 🇺🇸 flags, café naïve e\u0301 combining\n",
    "  leading spaces and\ttabs\n\n",
    "It's I'm we'll they've don't 12345 3.14159\n",
] * 20

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(pattern: str, nfc: bool) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, split by PATTERN first (GPT-2's family)."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_qwen(out: Path, template: str | None = None, qwen3: bool = True) -> Path:
    """A Qwen2/Qwen3-style tokenizer directory: ChatML specials, <think> and <tool_call> as plain added tokens."""
    out.mkdir(parents=True, exist_ok=True)
    tok = byte_level(QWEN_PATTERN, nfc=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    plain = ["<tool_call>", "</tool_call>"] + (["<think>", "</think>"] if qwen3 else [])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    # Tokens whose text holds spaces and newlines, as code models add them; one matched after normalization.
    tok.add_tokens([AddedToken("    ", special=False, normalized=False), AddedToken("\n\n", special=False, normalized=False),
                    AddedToken("<extra id>", special=False, normalized=True)])
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                      "single_word": t.single_word, "special": t.special}
             for i, t in tok.get_added_tokens_decoder().items()}
    config = {"add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
              "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
         "pad_token_id": tok.token_to_id("<|endoftext|>"), "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    return out


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]


def save_llama3(out: Path, template: str | None = None) -> Path:
    """A Llama 3-style tokenizer directory: BOS added by the post-processor, three EOS ids in generation_config."""
    out.mkdir(parents=True, exist_ok=True)
    tok = byte_level(LLAMA3_PATTERN, nfc=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                       "single_word": False, "special": True} for s in LLAMA3_SPECIALS}
    config = {"added_tokens_decoder": added, "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True,
              "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
              "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    ids = [tok.token_to_id(s) for s in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": ids,
                                                            "temperature": 0.6, "top_p": 0.9}))
    return out


def save_mistral(out: Path, template: str | None = None, legacy: bool = False) -> Path:
    """A Llama 2 / Mistral-style directory: BPE with byte fallback (<unk> <s> </s>, <0x00>..<0xFF>, then merges),
    Metaspace pre-tokenizer (legacy: the older Prepend/Replace normalizer), [INST] specials."""
    out.mkdir(parents=True, exist_ok=True)
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, limit_alphabet=120)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    inst = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in inst])
    # Phi-3's <|end|> eats the spaces after it (rstrip); RoBERTa's <mask> the ones before it (lstrip).
    tok.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False, rstrip=True),
                            AddedToken("<mask>", special=True, normalized=False, lstrip=True)])
    tok.add_tokens([AddedToken("<ctrl 1>", special=False, normalized=False),
                    AddedToken("\n\n", special=False, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                      "single_word": t.single_word, "special": t.special}
             for i, t in tok.get_added_tokens_decoder().items()}
    config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added, "bos_token": "<s>",
              "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": legacy,
              "model_max_length": 32768, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
              "use_default_system_prompt": False, "spaces_between_special_tokens": False}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


TEXTS = ["Hello world", " leading space", "  two leading", "\r\nline\r\n", "日本語 中文 한국어", "👩\u200d👩\u200d👧\u200d👦 🇺🇸 family",
         "e\u0301 combining ñ", "nul\x00 and \x01\x1b[0m ctrl", "<|im_end|>", "x<|im_end|>y", "<s>", "hi <s> there", "</s>",
         "<think>x</think>", " <|im_start|> ", "[INST] hi [/INST]", "<|eot_id|>", "tab\tend ", "\n\n\n", "", " ",
         "a  b   c", "ＡＢＣ fullwidth", "\u00a0nbsp", "<unk>", "<|begin_of_text|>hi", "emoji🤖text", "\ufeffbom",
         "def f():\n        return 1\n\n", "a <|end|>   b", "x   <mask> y", "<extra id> <EXTRA ID>", "<ctrl 1>\n\nz"]


@pytest.fixture(scope="module")
def families(tmp_path_factory, stories_path) -> dict[str, Path]:
    """Tokenizer directories of each family, stories260K's (a legacy Llama tokenizer) among them."""
    root = tmp_path_factory.mktemp("families")
    return {"qwen": save_qwen(root / "qwen"), "llama3": save_llama3(root / "llama3"),
            "mistral": save_mistral(root / "mistral"), "mistral_legacy": save_mistral(root / "legacy", legacy=True),
            "stories": stories_path}


def _pair(families, name):
    import transformers
    from minillm.tokenizer import Tokenizer
    return transformers.AutoTokenizer.from_pretrained(families[name]), Tokenizer.from_pretrained(families[name])


def decode_stream_text(tok, prompt: list[int], output: list[int], skip_special_tokens: bool) -> str:
    """vLLM's streamed text (FastIncrementalDetokenizer): a DecodeStream primed with the prompt's shortest tail of
    at least four tokens that decodes without U+FFFD, then stepped over the output."""
    from tokenizers.decoders import DecodeStream
    backend = tok.backend
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    suffix = prompt
    if len(prompt) > 4:
        suffix = next((prompt[-i:] for i in range(4, min(len(prompt) + 1, 24))
                       if "\ufffd" not in backend.decode(prompt[-i:], skip_special_tokens=False)), prompt)
    for t in suffix:
        stream.step(backend, t)
    return "".join(stream.step(backend, t) or "" for t in output)


def streamed(tok, prompt: list[int], output: list[int], skip_special_tokens: bool) -> str:
    """minillm's streamed text of OUTPUT after PROMPT."""
    from minillm.tokenizer import IncrementalDetokenizer
    det = IncrementalDetokenizer(tok, skip_special_tokens, prompt)
    return "".join(det.add(t) for t in output) + det.flush()


def random_splits(tok, rng: random.Random, count: int):
    """(prompt, output, skip_special_tokens) cut at random points of the encodings of tricky texts (many cut a
    character's bytes between prompt and output) and of random ids."""
    for i in range(count):
        if i % 3 == 0:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 20))]
        else:
            text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(1, 4)))
            ids = tok.encode(text, add_special_tokens=rng.random() < 0.5)
        cut = rng.randrange(0, len(ids) + 1)
        yield ids[:cut], ids[cut:], rng.random() < 0.5


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "mistral_legacy", "stories"])
def test_streamed_text_is_vllm_decode_stream_text(families, name):
    """The streamed text of every output, the prompt cut anywhere (inside a character too), is the text vLLM's
    DecodeStream-based detokenizer gives: a character the prompt's last bytes began and the output's first ones
    complete is the output's (it was dropped for byte-level BPE, whose tokens are no <0xNN> byte tokens)."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(families[name])
    rng = random.Random(name)
    for prompt, output, skip in random_splits(tok, rng, 600):
        if "\ufffd" in tok.decode(prompt + output, skip_special_tokens=skip):
            continue            # bytes that are no UTF-8: each detokenizer places its U+FFFD its own way
        assert streamed(tok, prompt, output, skip) == decode_stream_text(tok, prompt, output, skip), (prompt, output)


def test_byte_level_prompt_cut_inside_a_character(families):
    """A prompt of ids that ends inside '🤖' (a byte-level BPE token holds its first bytes): the output's token that
    completes it streams the whole character, as vLLM's."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(families["qwen"])
    ids = tok.encode("emoji🤖text")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    assert streamed(tok, ids[:cut], ids[cut:], True) == tok.decode(ids)[len("emoji"):]


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral"])
def test_encode_decode_match_transformers(families, name):
    """Encoding (special tokens added or not, added tokens with lstrip/rstrip/normalized, text equal to a special
    token's) and decoding (special tokens skipped or not) of tricky text, and the named ids, as transformers'.
    The legacy Llama families are left out: transformers 5 rebuilds a LlamaTokenizer's pipeline (Metaspace
    prepend_scheme "always") in place of the Prepend/Replace normalizer its tokenizer.json holds, which minillm
    (and the tokenizers library, and transformers 4) run."""
    ref, tok = _pair(families, name)
    for text in TEXTS:
        for add in (True, False):
            ids = ref.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert tok.tokenize(text) == ref.tokenize(text)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                     ref.pad_token_id)
    assert (len(tok), tok.vocab_size) == (len(ref), ref.vocab_size)


def vllm_stop_text(tok, prompt, output, stop, include, min_tokens=0, skip=True) -> tuple[str, str | None, int]:
    """(text, stop string, held back chars while running) as vLLM's detokenizer makes them: DecodeStream deltas,
    each token's new text searched for each stop string from len(stop) - 1 characters before it, the one that
    ends first winning, the list's order breaking ties (check_stop_strings), text of the first min_tokens tokens
    left out of the search."""
    text, held = "", max((len(s) for s in stop), default=1) - 1 if not include else 0
    for n in range(1, len(output) + 1):
        before = len(text)
        text += decode_stream_text(tok, prompt, output[:n], skip)[len(text):]
        if n <= min_tokens:
            continue
        found = [(at + len(s), i, at, s) for i, s in enumerate(stop)
                 if (at := text.find(s, max(before - len(s) + 1, 0))) != -1]
        if found:
            _, _, at, s = min(found)
            return (text[:at + len(s)] if include else text[:at]), s, held
    return text, None, held


def run_frontend(tok, prompt, output, **params) -> tuple[list[str], str, str | int | None]:
    """The API server's output processing of OUTPUT, one token a step, DELTA reports: (the streamed pieces, the
    FINAL_ONLY text of the same tokens, the stop reason)."""
    from minillm.engine_core import messages as m
    from minillm.engine_core.output_processor import OutputProcessor
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    results = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        proc = OutputProcessor(tok)
        proc.add("r", None, prompt, SamplingParams(max_tokens=len(output), output_kind=kind, **params), 0.0, "h")
        pieces, reason = [], None
        for i, token in enumerate(output):
            last = i == len(output) - 1
            seq = m.SeqOutput(0, [token], finish_reason="length" if last else None)
            done = proc.process(m.StepOutputs(i, 0.0, [m.RequestStepOutput("r", [seq], last, 0, None, None, None)]),
                                0.0)
            for _, out in done.outputs:
                pieces.append(out.outputs[0].text)
                reason = out.outputs[0].stop_reason
            if done.stops:
                break
        results[kind] = pieces, reason
    deltas, reason = results[RequestOutputKind.DELTA]
    final, final_reason = results[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final_reason == reason
    return deltas, final[0], reason


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "stories"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_straddling_tokens_as_vllm(families, name, include):
    """Stop strings cut out of the texts of random outputs (so that most straddle token boundaries, many inside a
    multi-byte character's tokens): the streamed pieces add up to the final text, which is vLLM's; the text is
    whole characters; nothing streamed is ever taken back."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(families[name])
    rng = random.Random(f"{name}{include}")
    checked = 0
    for prompt, output, skip in random_splits(tok, rng, 300):
        if "\ufffd" in tok.decode(prompt + output, skip_special_tokens=skip):
            continue
        full = decode_stream_text(tok, prompt, output, skip)
        if len(full) < 2:
            continue
        at = rng.randrange(len(full) - 1)
        stop = [full[at:at + rng.randrange(1, 5)], rng.choice(["zz", "\u200d👦", full[-1:]])]
        min_tokens = rng.choice([0, 0, 1, 2])
        text, reason, _ = vllm_stop_text(tok, prompt, output, stop, include, min_tokens, skip)
        deltas, final, got_reason = run_frontend(tok, prompt, output, stop=stop, include_stop_str_in_output=include,
                                                 min_tokens=min(min_tokens, len(output)), skip_special_tokens=skip)
        assert "".join(deltas) == final == text, (prompt, output, stop, min_tokens)
        assert got_reason == reason
        final.encode("utf-8")
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("include", [False, True])
def test_stream_holds_back_only_text_a_stop_string_would_cut(families, include):
    """While running, text that may begin a stop string is held back only when the stop string is to be cut out
    (vLLM's stop_buffer_length); with include_stop_str_in_output each token's text streams at once."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(families["qwen"])
    output = tok.encode("The quick brown fox jumps over the lazy dog.")
    deltas, final, reason = run_frontend(tok, [], output, stop=["over the lazy"], include_stop_str_in_output=include)
    assert reason == "over the lazy"
    assert final == ("The quick brown fox jumps over the lazy" if include else "The quick brown fox jumps ")
    if include:
        assert deltas[:3] == [tok.decode(output[:1]), tok.decode(output[1:2]), tok.decode(output[2:3])]
    else:
        assert deltas[0] == ""          # "The" could be the start of a stop string of 13 characters
    assert "".join(deltas) == final


@pytest.mark.parametrize("save", [save_qwen, save_mistral])
def test_split_special_tokens_from_tokenizer_config(tmp_path, save):
    """tokenizer_config.json's split_special_tokens: true encodes a special token's text as text (in chat template
    output too), as transformers does; added tokens that are not special stay whole. It was ignored."""
    import transformers
    from minillm.tokenizer import Tokenizer
    path = save(tmp_path / "split")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    ref, tok = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_pretrained(path)
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), text
    assert tok.encode("<|im_end|>", add_special_tokens=False) != [tok.backend.token_to_id("<|im_end|>")]
    conversation, template = [{"role": "user", "content": "x"}], "{{ '<s>[INST]' + messages[0].content + eos_token }}"
    assert tok.apply_chat_template(conversation, chat_template=template) == \
        list(ref.apply_chat_template(conversation, chat_template=template, return_dict=False))


def _with_dummy_model(path: Path, vocab_size: int) -> Path:
    """A tiny Qwen2 config beside the tokenizer files, for LLM(..., load_format="dummy")."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("save", [save_qwen, save_mistral])
def test_engine_streamed_text_equals_final_text_with_stop_strings(tmp_path, save):
    """Random outputs of a dummy-weight model (bytes that are no UTF-8 among them): each request's text streamed
    (CUMULATIVE) equals its text made once at the end (FINAL_ONLY), with stop strings picked from those texts,
    kept in the output or not."""
    from minillm.llm import LLM
    from minillm.sampling_params import RequestOutputKind, SamplingParams
    from minillm.tokenizer import Tokenizer
    path = save(tmp_path / "model")
    llm = LLM(str(_with_dummy_model(path, len(Tokenizer.from_pretrained(path)))), load_format="dummy", device="cpu",
              dtype="float32", seed=0, generation_config="vllm")
    prompts = ["日本語 emoji 👩\u200d👩\u200d👧\u200d👦", "Hello", "[INST] hi <|im_end|>\n"] * 2

    def texts(kind, stops=None):
        params = [SamplingParams(max_tokens=40, seed=i, output_kind=kind, skip_special_tokens=bool(i % 2),
                                 ignore_eos=True, stop=None if stops is None else stops[i],
                                 include_stop_str_in_output=i % 3 == 0) for i in range(len(prompts))]
        return [(o.outputs[0].text, o.outputs[0].stop_reason) for o in llm.generate(prompts, params)]

    plain = texts(RequestOutputKind.CUMULATIVE)
    assert plain == texts(RequestOutputKind.FINAL_ONLY)
    rng = random.Random(0)
    stops = []
    for text, _ in plain:
        words = [w for w in text.replace("\ufffd", " ").split(" ") if w]
        stops.append([rng.choice(words)[-3:], "never"] if words else ["never"])
    stopped = texts(RequestOutputKind.CUMULATIVE, stops)
    assert stopped == texts(RequestOutputKind.FINAL_ONLY, stops)
    assert sum(reason is not None for _, reason in stopped) >= 3


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "stories"])
def test_all_special_ids_as_transformers(families, name):
    """all_special_tokens / all_special_ids are the named special tokens and additional_special_tokens, in
    transformers' order (Llama 3's are BOS and EOS only, not its header and reserved specials), and
    convert_ids_to_tokens(skip_special_tokens=True) leaves out those alone; every added token marked special was
    listed, sorted by id."""
    ref, tok = _pair(families, name)
    assert tok.all_special_tokens == ref.all_special_tokens
    assert tok.all_special_ids == ref.all_special_ids
    ids = list(range(len(ref) - 12, len(ref))) + [0, 1, 2, 5]
    assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        ref.convert_ids_to_tokens(ids, skip_special_tokens=True)
