"""The offline API as a vLLM script uses it: names, prompt forms, progress bars, threads and SamplingParams helpers."""
import threading

import pytest

from minillm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=256) as model:
        yield model


def test_vllm_names_are_exported():
    """vLLM scripts import these from the package itself."""
    from minillm import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt
    from minillm.outputs import CompletionOutput as Completion, RequestOutput as Request
    assert (RequestOutput, CompletionOutput) == (Request, Completion)
    assert TokensPrompt(prompt_token_ids=[1, 403]) == {"prompt_token_ids": [1, 403]}
    assert TextPrompt(prompt="Once") == {"prompt": "Once"}


def test_typed_prompts_generate_like_plain_ones(llm):
    from minillm import TextPrompt, TokensPrompt
    typed = llm.generate([TextPrompt(prompt="Once"), TokensPrompt(prompt_token_ids=[1, 403])], GREEDY)
    plain = llm.generate(["Once", [1, 403]], GREEDY)
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]


def test_generate_from_threads_finishes_with_each_threads_outputs(llm):
    """Two threads calling generate at once spun forever, each stepping away the other's outputs."""
    prompts = {i: [f"Once {i}", f"Lily {i}"] for i in range(3)}
    expected = {i: [o.outputs[0].text for o in llm.generate(p, GREEDY)] for i, p in prompts.items()}
    got, errors = {}, []

    def run(i):
        try:
            got[i] = [o.outputs[0].text for o in llm.generate(prompts[i], GREEDY)]
        except Exception as exc:       # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "generate from several threads did not finish"
    assert not errors
    assert got == expected


def test_use_tqdm_callable_makes_the_bar(llm):
    """vLLM's use_tqdm may be a callable that builds the progress bar; it was ignored."""
    made = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed = kwargs, 0, False
            made.append(self)

        def update(self, k=1):
            self.n += k

        def close(self):
            self.closed = True

    llm.generate(["Once", "Lily"], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert len(made) == 1
    assert made[0].kwargs["total"] == 2 and made[0].n == 2 and made[0].closed


def test_empty_string_prompt_is_the_bos_token(llm):
    """vLLM tokenizes "" to the tokenizer's BOS and generates from it; minillm refused the prompt."""
    [out] = llm.generate("", GREEDY)
    assert out.prompt == "" and out.prompt_token_ids == [1]
    assert out.outputs[0].token_ids == llm.generate([[1]], GREEDY)[0].outputs[0].token_ids


def test_chat_without_template_names_the_chat_template_argument(llm):
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)


def test_sampling_params_clone_is_independent():
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0}, seed=5)
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[4] = 2.0
    assert params.stop == ["x"] and params.logit_bias == {3: 1.0}
    assert copy.seed == 5 and copy is not params


def test_sampling_params_from_optional():
    """vLLM's from_optional: None takes the default, except max_tokens (None: no limit)."""
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          max_tokens=None, logit_bias={"5": 250.0, 6: -1.5})
    assert (params.n, params.temperature, params.top_p, params.presence_penalty) == (1, 1.0, 1.0, 0.0)
    assert params.max_tokens is None
    assert params.logit_bias == {5: 100.0, 6: -1.5}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_optional(logit_bias={"five": 1.0})


def test_spaces_between_special_tokens_is_taken(llm):
    """lm-evaluation-harness passes spaces_between_special_tokens=False; it was a TypeError."""
    params = SamplingParams(temperature=0, max_tokens=8, spaces_between_special_tokens=False)
    assert llm.generate("Once", params)[0].outputs[0].text == llm.generate("Once", GREEDY)[0].outputs[0].text
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


def test_chat_tools_reach_the_template(llm):
    """vLLM's LLM.chat takes tools and renders them with the template; it was a TypeError."""
    template = "{{ bos_token }}{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    [out] = llm.chat([{"role": "user", "content": "Tom"}], GREEDY, chat_template=template, tools=tools)
    assert out.prompt == "<s>get_weather;Tom"
    with pytest.raises(ValueError, match="tools"):
        llm.chat([{"role": "user", "content": "Tom"}], GREEDY, chat_template=template, tools="get_weather")


def test_a_failing_progress_bar_leaves_no_request_behind(llm):
    """A use_tqdm callable that raised left the call's requests queued, to run inside the next call."""
    def broken_bar(**kwargs):
        raise RuntimeError("no terminal")

    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate(["Once", "Lily"], GREEDY, use_tqdm=broken_bar)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_engine_hands_out_the_tokenizer_as_vllms_does(llm):
    tok = llm.llm_engine.get_tokenizer()
    assert tok is llm.get_tokenizer()
    assert tok.decode(tok("Once upon a time")["input_ids"], skip_special_tokens=True) == "Once upon a time"
