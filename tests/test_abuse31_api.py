"""The offline API used as a vLLM user uses it: LLM, its tokenizer, SamplingParams and the outputs."""
import pytest


def greedy(**fields):
    """Greedy SamplingParams of 2 tokens, with fields."""
    from minillm import SamplingParams
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, **fields})


def test_tokenizer_call_result_reads_as_attributes_too(llm):
    """transformers' BatchEncoding: tokenizer(text).input_ids, as vLLM's get_tokenizer() hands it out."""
    tok = llm.get_tokenizer()
    enc = tok("Once upon a time")
    assert enc.input_ids == enc["input_ids"] == tok.encode("Once upon a time")
    assert enc.attention_mask == [1] * len(enc.input_ids)
    batch = tok(["Lily", "Once upon"], add_special_tokens=False)
    assert batch.input_ids == [tok.encode("Lily", add_special_tokens=False),
                               tok.encode("Once upon", add_special_tokens=False)]
    chat = tok.apply_chat_template([{"role": "user", "content": "Lily"}], chat_template="{{ messages[0].content }}",
                                   return_dict=True)
    assert chat.input_ids == tok.encode("Lily", add_special_tokens=False)
    with pytest.raises(AttributeError, match="token_type_ids"):
        enc.token_type_ids


def test_llm_has_vllms_model_config_attribute(llm):
    """vLLM's LLM keeps its engine's model config as llm.model_config (llm.model_config.max_model_len)."""
    assert llm.model_config is llm.llm_engine.model_config
    assert llm.model_config.max_model_len == 128


@pytest.mark.parametrize("name, value", [("logprobs_mode", "raw_logprobs"), ("code_revision", None)])
def test_vllm_engine_args_at_what_minillm_does_are_taken(stories_path, name, value):
    """vLLM's logprobs_mode (its default, raw_logprobs: minillm's log-probabilities are the model's
    before any penalty) and code_revision (None) are taken; other values are named."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=64, **{name: value}) as model:
        assert model.generate("Lily", greedy())[0].outputs[0].token_ids
    other = {"logprobs_mode": "processed_logprobs", "code_revision": "main"}[name]
    with pytest.raises(ValueError, match=f"^{name}="):
        LLM(str(stories_path), device="cpu", max_model_len=64, **{name: other})


def _finished_outputs(engine) -> dict:
    """Step the engine until it holds no request; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


@pytest.mark.parametrize("detokenize", [True, False])
def test_llm_engine_prompt_logprobs_are_vllms_logprobs(llm, detokenize):
    """Through LLMEngine (as vLLM's llm_engine_example steps it), every prompt_logprobs entry is a
    Logprob (.logprob, .rank, .decoded_token) as LLM.generate's are; the top alternatives were bare
    floats, so entry[t].logprob raised AttributeError."""
    from minillm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, detokenize=detokenize)
    engine = llm.llm_engine
    engine.add_request("plp", "Once upon a time", params)
    got = _finished_outputs(engine)["plp"].prompt_logprobs
    want = llm.generate("Once upon a time", params)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want) == 5
    for entry, wanted in zip(got[1:], want[1:]):
        assert {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()} == \
            {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in wanted.items()}
        assert sorted(lp.rank for lp in entry.values())[:2] == [1, 2]
        assert all((lp.decoded_token is not None) == detokenize for lp in entry.values())


def test_logprob_repr_shows_rank_and_decoded_token(llm):
    """Printing an output shows each Logprob as vLLM's does (logprob, rank, decoded_token), not a bare
    float that hides the rank and the token's text; str() and JSON still give the number."""
    import json
    out = llm.generate("Once upon", greedy(logprobs=1))[0].outputs[0]
    lp = out.logprobs[0][out.token_ids[0]]
    assert repr(lp) == f"Logprob(logprob={float(lp)!r}, rank=1, decoded_token={lp.decoded_token!r})"
    assert lp.decoded_token and repr(lp) in repr(out)
    assert str(lp) == f"{lp}" == str(float(lp)) and json.loads(json.dumps(lp)) == float(lp)


def test_logprobs_dicts_list_the_sampled_and_prompt_token_first(llm):
    """vLLM builds each logprobs dict with the sampled (or prompt) token first and then the top k, so
    next(iter(d.values())) is the chosen token's Logprob (as TRL reads it); minillm listed the top k
    first, so that read the likeliest token's wherever sampling picked another."""
    from minillm import SamplingParams
    params = SamplingParams(temperature=3.0, seed=5, max_tokens=12, logprobs=2, prompt_logprobs=2)
    out = llm.generate("Once upon a time there", params)[0]
    completion = out.outputs[0]
    assert any(d[t].rank > 1 for t, d in zip(completion.token_ids, completion.logprobs))   # the case at stake
    assert [next(iter(d)) for d in completion.logprobs] == completion.token_ids
    assert [next(iter(d)) for d in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    assert any(d[t].rank > 1 for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))


def test_request_metrics_time_in_queue(llm):
    """vLLM's RequestMetrics.time_in_queue: seconds from arrival to first being scheduled (None before)."""
    from minillm.outputs import RequestMetrics
    metrics = llm.generate("Lily", greedy())[0].metrics
    assert metrics.time_in_queue == metrics.first_scheduled_time - metrics.arrival_time >= 0
    assert RequestMetrics(arrival_time=1.0).time_in_queue is None


def test_chat_template_may_be_the_path_of_a_file(llm, tmp_path):
    """LLM.chat's chat_template names a file as vLLM's load_chat_template reads it; the path itself was
    rendered as a template of plain text, so the prompt was the path and nothing of the messages."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "Once upon a time"}]
    assert llm.chat(messages, greedy(), chat_template=str(template))[0].prompt == "Once upon a time"
    with pytest.raises(ValueError, match="chat_template.*no such file"):
        llm.chat(messages, greedy(), chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_may_still_name_one_of_the_models_templates(llm):
    """A name of one of the model's templates (tokenizer_config.json's list) selects it, as before."""
    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = {"default": "default: {{ messages[0]['content'] }}",
                         "tool_use": "tools: {{ messages[0]['content'] }}"}
    try:
        out = llm.chat([{"role": "user", "content": "Lily"}], greedy(), chat_template="tool_use")[0]
    finally:
        tok.chat_template = saved
    assert out.prompt == "tools: Lily"


def test_chat_passes_tool_call_arguments_to_the_template_as_data(llm):
    """vLLM's LLM.chat parses an assistant tool call's arguments before the template reads them (as the
    server does): `arguments | tojson` rendered the JSON text quoted a second time here."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};"
                "{% endfor %}{% endfor %}")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    out = llm.chat(messages, greedy(max_tokens=1), chat_template=template)
    assert out[0].prompt == '{"city": "Paris"};{};'
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'      # the caller's messages untouched
    calls[0]["function"]["arguments"] = '{"city": '
    with pytest.raises(ValueError, match=r"messages\[1\]\['tool_calls'\]\[0\]\['function'\]\['arguments'\] must be JSON"):
        llm.chat(messages, greedy(max_tokens=1), chat_template=template)


def test_tokenizer_takes_the_transformers_idioms_user_code_reaches_for(stories_path):
    """tok.pad_token = tok.eos_token, decode(token_ids=...), encode_plus, num_special_tokens_to_add,
    padding_side and vLLM's max_token_id: each was an AttributeError or a TypeError."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(stories_path)
    tok.pad_token = tok.eos_token
    assert (tok.pad_token, tok.pad_token_id) == (tok.eos_token, tok.eos_token_id)
    with pytest.raises(ValueError, match="pad_token must be a string"):
        tok.pad_token = 3
    ids = tok.encode("Once upon a time")
    assert tok.decode(token_ids=ids) == tok.decode(ids)
    assert tok.encode_plus("Once upon a time").input_ids == ids
    assert tok.batch_encode_plus(["Lily"]).input_ids == [tok.encode("Lily")]
    assert tok.num_special_tokens_to_add() == len(ids) - len(tok.encode("Once upon a time", add_special_tokens=False))
    assert tok.max_token_id == len(tok) - 1
    assert (tok.padding_side, tok.truncation_side) == ("right", "right")
