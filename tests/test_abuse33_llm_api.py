"""The offline API as vLLM users drive it: LLM.generate, LLM.chat and SamplingParams given what vLLM
takes (top_k past the vocabulary, its progress-bar default, ...), with the same meaning here."""
from __future__ import annotations

import asyncio
import errno
import io

import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures
from test_cli import STORIES, needs_stories, run_main

from minillm import SamplingParams
from minillm.sampling_metadata import row_values

VOCAB = 512        # stories260K's
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=12)


def _ids(outputs):
    return [c.token_ids for out in outputs for c in out.outputs]


# ---- top_k past the vocabulary: the whole vocabulary, as vLLM and minillm's server take it -------

@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 2**31, 2**63, 10**30])
def test_generate_takes_top_k_past_the_vocabulary_as_off(llm, top_k):
    # It was "top_k must be at most the vocabulary size 512" where vLLM (and minillm's server) sample
    # from the whole vocabulary.
    want = _ids(llm.generate(["Once upon a time"], SamplingParams(top_k=-1, **SAMPLED), use_tqdm=False))
    got = _ids(llm.generate(["Once upon a time"], SamplingParams(top_k=top_k, **SAMPLED), use_tqdm=False))
    assert got == want
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("top_k, packed", [(-1, 0), (0, 0), (1, 1), (VOCAB - 1, VOCAB - 1), (VOCAB, 0),
                                           (VOCAB + 1, 0), (2**40, 0), (10**30, 0)])
def test_the_sampler_reads_a_top_k_within_its_bounds(top_k, packed):
    # The packed row is float64 then int32: 2**40 wrapped, 10**30 was undefined in the cast.
    assert row_values(SamplingParams(top_k=top_k), VOCAB)[1] == packed


@needs_stories
def test_generate_cli_takes_top_k_past_the_vocabulary(capsys):
    args = ("generate", str(STORIES), "--device", "cpu", "-p", "Once", "--max-tokens", "6", "--seed", "3")
    status, want, err = run_main(capsys, *args, "--top-k", "-1")
    assert status == 0, err
    status, got, err = run_main(capsys, *args, "--top-k", "100000")
    assert status == 0 and "Traceback" not in err, err
    assert got == want


async def _ids_of(engine, request_id: str, params: SamplingParams) -> list[int]:
    stream = await engine.add_request(request_id, "Once upon a time", params)
    return [out async for out, _ in stream][-1].outputs[0].token_ids


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
def test_async_engines_take_any_top_k_past_the_vocabulary(request, engine_name):
    # AsyncLLM sent a top_k past 2**64 - 1 to its engine core through msgpack: "the request cannot be
    # sent to the engine core: can't serialize ints ...", naming no field.
    engine = request.getfixturevalue(engine_name)
    want = asyncio.run(_ids_of(engine, f"{engine_name}-off", SamplingParams(top_k=-1, **SAMPLED)))
    for top_k in (VOCAB + 1, 2**64, 10**30):
        assert asyncio.run(_ids_of(engine, f"{engine_name}-{top_k}", SamplingParams(top_k=top_k, **SAMPLED))) == want


# ---- use_tqdm: vLLM's default, a progress bar on stderr -------------------------------------------

def test_generate_and_chat_show_vllms_progress_bar_on_stderr_by_default(llm, capsys):
    # vLLM's generate and chat default to use_tqdm=True; minillm's defaulted to no bar.
    capsys.readouterr()
    llm.generate(["Once", "Lily"], SamplingParams(max_tokens=2))
    out, err = capsys.readouterr()
    assert out == "" and "100%" in err and "2/2" in err, err
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2),
             chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    out, err = capsys.readouterr()
    assert out == "" and "1/1" in err, err
    llm.generate(["Once", "Lily"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr() == ("", "")


class _FullStream(io.TextIOBase):
    """A stderr whose writes fail as on a full disk or a closed descriptor (`2>/dev/full`, `2>&-`)."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.EBADF, "Bad file descriptor")


@pytest.mark.parametrize("stderr", [None, _FullStream()], ids=["none", "full"])
def test_the_default_progress_bar_never_fails_generate(llm, monkeypatch, stderr):
    # With the bar on by default, a script run with stderr closed (sys.stderr None, as under pythonw)
    # or full failed in generate ("'NoneType' object has no attribute 'write'", OSError) where the
    # same script without a bar ran.
    want = _ids(llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False))
    monkeypatch.setattr("sys.stderr", stderr)
    assert _ids(llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=3))) == want
    assert not llm.llm_engine.has_unfinished_requests()


# ---- LLM.chat's arguments in vLLM's order, tokenization_kwargs among them -------------------------

PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
HI = [{"role": "user", "content": "Hi"}]


def test_chat_takes_vllms_arguments_by_position(llm):
    # vLLM's order is (messages, sampling_params, use_tqdm, lora_request, chat_template,
    # chat_template_content_format, add_generation_prompt, continue_final_message, tools, ...); minillm's
    # fourth was chat_template and its fifth add_generation_prompt, so a template given by position was
    # taken for add_generation_prompt and the model's own (here: none) was used.
    [out] = llm.chat(HI, SamplingParams(temperature=0, max_tokens=2), False, None, "<s>" + PLAIN, "string", False)
    assert out.prompt == "<s>Hi"


def test_chat_takes_tokenization_kwargs(llm):
    # vLLM's chat takes tokenization_kwargs (its add_special_tokens defaults to False there: the template
    # writes BOS where the model wants it); it was a TypeError.
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [plain] = llm.chat(HI, greedy, use_tqdm=False, chat_template=PLAIN)
    [special] = llm.chat(HI, greedy, use_tqdm=False, chat_template=PLAIN,
                         tokenization_kwargs={"add_special_tokens": True})
    bos = llm.get_tokenizer().bos_token_id
    assert plain.prompt_token_ids[0] != bos and special.prompt_token_ids == [bos] + plain.prompt_token_ids
    [empty] = llm.chat(HI, greedy, use_tqdm=False, chat_template=PLAIN, tokenization_kwargs={})
    assert empty.prompt_token_ids == plain.prompt_token_ids
    with pytest.raises(ValueError, match="^tokenization_kwargs 'truncation': not supported"):
        llm.chat(HI, greedy, use_tqdm=False, chat_template=PLAIN, tokenization_kwargs={"truncation": True})
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
def test_async_engines_take_counts_past_the_context_as_the_offline_engine(request, engine_name):
    # max_tokens and min_tokens past 2**64 - 1 (any past the context means the same) failed AsyncLLM's
    # send: "the request cannot be sent to the engine core: can't serialize ints". (A truncate_prompt_tokens
    # past the context is refused by name, as vLLM refuses it: test_abuse33_parity.py.)
    engine = request.getfixturevalue(engine_name)
    greedy = dict(temperature=0, ignore_eos=True)
    want = asyncio.run(_ids_of(engine, f"{engine_name}-plain", SamplingParams(max_tokens=None, **greedy)))
    for name, fields in (("max", dict(max_tokens=10**30)), ("min", dict(max_tokens=None, min_tokens=10**30))):
        params = SamplingParams(**fields, **greedy)
        assert asyncio.run(_ids_of(engine, f"{engine_name}-{name}", params)) == want, name


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
@pytest.mark.parametrize("field, params", [
    ("stop_token_ids", SamplingParams(stop_token_ids=[10**30])),
    ("logit_bias", SamplingParams(logit_bias={10**30: 1.0})),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=[VOCAB])),
])
def test_async_engines_name_a_token_id_past_the_vocabulary(request, engine_name, field, params):
    # AsyncLLM said "the request cannot be sent to the engine core: can't serialize ints ..." for ids
    # past 2**64, naming no field, where LLMEngine names it.
    engine = request.getfixturevalue(engine_name)

    async def scenario():
        with pytest.raises(ValueError, match=f"^{field}( keys)? must be token ids in \\[0, {VOCAB}\\)"):
            await engine.add_request(f"{engine_name}-{field}", "Once", params)
    asyncio.run(scenario())


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"])
def test_an_empty_multimodal_key_of_a_prompt_dict_is_taken_as_none(llm, key):
    # {"mm_processor_kwargs": {}} was "prompt dict has unsupported key(s)" where None was taken, and
    # LLM.chat(mm_processor_kwargs={}) too: an empty dict asks for nothing minillm does not do.
    greedy = SamplingParams(temperature=0, max_tokens=3)
    want = _ids(llm.generate({"prompt": "Once"}, greedy, use_tqdm=False))
    assert _ids(llm.generate({"prompt": "Once", key: {}}, greedy, use_tqdm=False)) == want
    with pytest.raises(ValueError, match=f"unsupported key\\(s\\) \\['{key}'\\].*minillm runs text-only models"):
        llm.generate({"prompt": "Once", key: {"image": "x"}}, greedy, use_tqdm=False)
