"""Model folders as Hugging Face models ship them (Llama 3, Qwen, Mistral style tokenizer_config.json,
generation_config.json, a generation_config folder), read by minillm as transformers and vLLM read them."""
from __future__ import annotations

import json

import httpx
import pytest

from test_abuse29_tokenizers import CORPUS, save_llama3, save_mistral, save_qwen
from test_server_helpers import running_server


def edit_tokenizer_config(folder, **changes):
    """folder with its tokenizer_config.json's added_tokens_decoder entries updated: content -> flags."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for entry in config["added_tokens_decoder"].values():
        entry.update(changes.get(entry["content"], {}))
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def capped_folder(tmp_path_factory):
    """A generation_config folder (vLLM's --generation-config FOLDER) asking for max_new_tokens 5."""
    folder = tmp_path_factory.mktemp("gen-folder")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "eos_token_id": 2}))
    return folder


@pytest.mark.parametrize("override, expected", [(None, 5), ({"max_new_tokens": 3}, 3)])
def test_a_generation_config_folders_max_new_tokens_caps_a_requests_max_tokens(stories_path, capped_folder,
                                                                                override, expected):
    """vLLM's server caps max_tokens by the folder's max_new_tokens (the override's over it), as it caps
    by override_generation_config's under auto: a request asking for 20 tokens got 20."""
    with running_server(stories_path, generation_config=str(capped_folder),
                        override_generation_config=override) as (url, _):
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True,
                "temperature": 0}
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert done["usage"]["completion_tokens"] == expected, done


def test_added_tokens_decoder_flags_in_tokenizer_config_are_taken_as_transformers_takes_them(tmp_path):
    """tokenizer_config.json's added_tokens_decoder wins over tokenizer.json's flags: <think> marked special
    there is dropped by decode(skip_special_tokens=True), and [INST] with lstrip/rstrip there eats the
    spaces beside it; minillm read tokenizer.json's flags alone (and a token of the vocabulary listed
    there is an added token, matched whole)."""
    transformers = pytest.importorskip("transformers")
    from minillm.tokenizer import Tokenizer
    qwen = edit_tokenizer_config(save_qwen(tmp_path / "qwen"), **{"<think>": {"special": True},
                                                                   "<|im_end|>": {"special": False}})
    mistral = save_mistral(tmp_path / "mistral")
    word = Tokenizer.from_pretrained(mistral).id_to_token(300)
    config = json.loads((mistral / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["300"] = {"content": word, "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False, "special": True}
    (mistral / "tokenizer_config.json").write_text(json.dumps(config))
    edit_tokenizer_config(mistral, **{"[INST]": {"lstrip": True, "rstrip": True}})
    texts = {qwen: ["<think>plan</think> answer<|im_end|>", "a <think> b"],
             mistral: ["x  [INST]  hi [/INST] ok", f"hello {word.replace(chr(0x2581), ' ')} there"]}
    for folder, cases in texts.items():
        ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
        for text in cases:
            ids = theirs.encode(text)
            assert ours.encode(text) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert Tokenizer.from_pretrained(qwen).decode(Tokenizer.from_pretrained(qwen).encode("<think>x"),
                                                  skip_special_tokens=True) == "x"


def save_unigram(out, clean_up: bool):
    """A SentencePiece Unigram tokenizer directory (T5 / XGLM style, Metaspace), clean_up_tokenization_spaces
    as given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                           unk_token="<unk>", show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": clean_up,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


CLEAN_UP_TEXTS = ["Hello world . It 's fine , is n't it ? yes ! I 'm here , we 're ' quoted ' ok",
                  "def main ( ) : return 42 ."]


@pytest.mark.parametrize("clean_up", [True, False])
def test_decode_cleans_up_tokenization_spaces_as_transformers_does(tmp_path, clean_up):
    """decode() follows tokenizer_config.json's clean_up_tokenization_spaces, and a call's own value, as
    transformers' decode: the spaces before punctuation go for a Unigram (or WordPiece) tokenizer, a BPE
    tokenizer's text is left alone (clean_up_tokenization_spaces=True was a ValueError, and the config's
    setting was never read)."""
    transformers = pytest.importorskip("transformers")
    from minillm.tokenizer import Tokenizer
    folders = [save_unigram(tmp_path / "unigram", clean_up), save_llama3(tmp_path / "llama3")]
    for folder in folders:
        ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
        for text in CLEAN_UP_TEXTS:
            ids = theirs.encode(text)
            assert ours.decode(ids) == theirs.decode(ids), text
            for flag in (True, False):
                assert ours.decode(ids, clean_up_tokenization_spaces=flag) == \
                    theirs.decode(ids, clean_up_tokenization_spaces=flag)
                assert ours.batch_decode([ids], clean_up_tokenization_spaces=flag) == \
                    theirs.batch_decode([ids], clean_up_tokenization_spaces=flag)
    unigram = Tokenizer.from_pretrained(folders[0])
    ids = unigram.encode("It 's fine .")
    assert unigram.decode(ids) == ("It's fine." if clean_up else "It 's fine .")


def test_streamed_text_is_the_decoders_own_as_vllms_detokenizer_reads_it(tmp_path):
    """The text a request streams is the tokenizer.json decoder's, as vLLM's DecodeStream gives it, whatever
    clean_up_tokenization_spaces says (transformers applies it in decode() alone)."""
    from minillm.tokenizer import IncrementalDetokenizer, Tokenizer
    tok = Tokenizer.from_pretrained(save_unigram(tmp_path / "unigram", True))
    ids = tok.encode("Say it . It 's fine , I 'm here !")
    det = IncrementalDetokenizer(tok, prompt_token_ids=ids[:2])
    text = "".join(det.add(i) for i in ids[2:]) + det.flush()
    assert text.endswith(" . It 's fine , I 'm here !")
    assert tok.decode(ids).endswith(". It's fine, I'm here!")
