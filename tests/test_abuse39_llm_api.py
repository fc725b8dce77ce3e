"""vLLM's offline API as its users write it, run against minillm with only the import changed:
LLM.beam_search with BeamSearchParams, checked against a search written here over transformers'
log-probabilities (and, for EOS and length limits, the engine's own top 20 of each prefix)."""
from __future__ import annotations

import json
import math

import pytest

from minillm import LLM, SamplingParams
from minillm.beam_search import BeamSearchOutput, BeamSearchSequence, get_beam_search_score
from minillm.sampling_params import BeamSearchParams

PROMPTS = ["Once upon a time", "Lily and Tom", "The cat sat"]
PERIOD = 426          # "." in stories260K's vocabulary


@pytest.fixture(scope="module")
def period_eos_path(stories_path, tmp_path_factory):
    """stories260K whose tokenizer names "." its EOS: beams end on it within a few tokens."""
    out = tmp_path_factory.mktemp("stories_period_eos")
    for f in stories_path.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((stories_path / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "."}))
    return out


@pytest.fixture(scope="module")
def period_llm(period_eos_path):
    with LLM(str(period_eos_path), device="cpu", max_model_len=64) as model:
        yield model


@pytest.fixture(scope="module")
def hf_model(stories_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")       # the test extras bring transformers without torch
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()


def _hf_logprobs(model):
    """A prefix's next-token log-probabilities {token: logprob} from transformers' model (all the vocabulary)."""
    import torch

    def logprobs_of(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        return dict(enumerate(torch.log_softmax(logits, -1).tolist()))
    return logprobs_of


def _engine_logprobs(llm):
    """A prefix's 20 likeliest next tokens {token: logprob}, asked of the engine alone, one request a prefix."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)

    def logprobs_of(tokens):
        [out] = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)
        return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
    return logprobs_of


def _reference(logprobs_of, prompt_ids, width, steps, eos, length_penalty=1.0, ignore_eos=False, max_len=10**9):
    """Beam search as vLLM defines it: each beam's 2 * width likeliest next tokens are candidates, an EOS
    one is completed, the width best others live on; the width best (tokens, cumulative logprob)."""
    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    beams, completed = [(list(prompt_ids), 0.0)], []
    for _ in range(steps):
        if not beams or len(beams[0][0]) >= max_len:
            break
        candidates = []
        for tokens, cum in beams:
            logprobs = logprobs_of(tokens)
            for token in sorted(logprobs, key=logprobs.get, reverse=True)[:2 * width]:
                new = (tokens + [token], cum + logprobs[token])
                (completed if token == eos and not ignore_eos else candidates).append(new)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


def _summary(output: BeamSearchOutput):
    return [(s.tokens, s.cum_logprob) for s in output.sequences]


def _assert_same_beams(got: BeamSearchOutput, want):
    assert [s.tokens for s in got.sequences] == [tokens for tokens, _ in want]
    for seq, (_, cum) in zip(got.sequences, want):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)


# ---- LLM.beam_search: it was an AttributeError ('minillm has no beam search') -------------------

def test_beam_search_finds_the_beams_of_a_search_over_transformers_logits(llm, hf_model):
    """One test (not one a width): transformers' model loads once."""
    for width, steps in [(2, 6), (3, 5)]:
        _check_the_beams_of_transformers(llm, _hf_logprobs(hf_model), width, steps)


def _check_the_beams_of_transformers(llm, logprobs_of, width, steps):
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps))
    tok = llm.get_tokenizer()
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        _assert_same_beams(out, _reference(logprobs_of, ids, width, steps, tok.eos_token_id))
        for seq in out.sequences:
            assert isinstance(seq, BeamSearchSequence)
            assert seq.tokens[:len(ids)] == ids and len(seq.tokens) == len(ids) + steps
            assert seq.text == tok.decode(seq.tokens)            # the prompt and <s> too, as vLLM's
            assert seq.finish_reason == "length" and seq.stop_reason is None
            assert len(seq.logprobs) == steps
            for token, candidates in zip(seq.tokens[len(ids):], seq.logprobs):
                assert token in candidates and len(candidates) >= 2 * width
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_ending_on_eos_are_completed_and_ranked_with_the_length_penalty(period_llm, length_penalty):
    tok = period_llm.get_tokenizer()
    assert tok.eos_token_id == PERIOD
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=length_penalty)
    [out] = period_llm.beam_search(["Lily and Tom"], params)
    want = _reference(_engine_logprobs(period_llm), tok.encode("Lily and Tom"), 3, 12, PERIOD, length_penalty)
    _assert_same_beams(out, want)
    stopped = [s for s in out.sequences if s.tokens[-1] == PERIOD]
    assert stopped, "no beam ended on EOS: the test no longer covers completed beams"
    assert all(s.finish_reason == "stop" for s in stopped)
    assert all(s.finish_reason == "length" for s in out.sequences if s not in stopped)
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, PERIOD, length_penalty) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_ignore_eos_grows_past_eos_and_width_one_is_greedy(period_llm):
    tok = period_llm.get_tokenizer()
    params = BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True)
    [out] = period_llm.beam_search("Lily and Tom", params)
    [greedy] = period_llm.generate("Lily and Tom", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)
    [seq] = out.sequences
    assert seq.tokens[len(greedy.prompt_token_ids):] == greedy.outputs[0].token_ids
    assert PERIOD in seq.tokens and seq.finish_reason == "length"
    want = _reference(_engine_logprobs(period_llm), tok.encode("Lily and Tom"), 1, 12, PERIOD, ignore_eos=True)
    _assert_same_beams(out, want)


def test_beams_stop_where_they_fill_max_model_len(period_llm):
    prompt = [1] + [PERIOD + 1] * 58           # 59 tokens: room for 5 under max_model_len 64
    [out] = period_llm.beam_search([{"prompt_token_ids": prompt}],
                                   BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))
    want = _reference(_engine_logprobs(period_llm), prompt, 2, 20, PERIOD, ignore_eos=True, max_len=64)
    _assert_same_beams(out, want)
    assert [len(s.tokens) for s in out.sequences] == [64, 64]
    assert not period_llm.llm_engine.has_unfinished_requests()


def test_concurrency_limit_and_prompt_forms_give_the_same_beams(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    whole = llm.beam_search(PROMPTS, params)
    forms = [PROMPTS[0], {"prompt_token_ids": ids}, {"prompt": PROMPTS[2], "cache_salt": "s"}]
    limited = llm.beam_search(forms, params, concurrency_limit=1)
    for got, want in zip(limited, whole):      # a batch of other rows may move the last bits
        _assert_same_beams(got, _summary(want))


def test_use_tqdm_shows_the_steps_on_stderr(llm, capfd):
    llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=True)
    out, err = capfd.readouterr()
    assert "Beam search" in err and "3/3" in err and out == ""
    llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=True, concurrency_limit=1)
    assert "Beam search" not in capfd.readouterr().err      # as vLLM: no bar with a concurrency limit


@pytest.mark.parametrize("fields, needle", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width must be an integer in \[1, 10\].*2 \* beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=-1), "max_tokens must be an integer >= 0"),
    (dict(beam_width=2, max_tokens=4, temperature=-0.5), "temperature must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be true or false"),
    (dict(beam_width=2, max_tokens=4, structured_outputs=object()), "structured_outputs must be a Structured"),
])
def test_beam_search_params_name_a_bad_field(fields, needle):
    with pytest.raises(ValueError, match=needle):
        BeamSearchParams(**fields)


@pytest.mark.parametrize("call, needle", [
    (lambda llm, p: llm.beam_search(PROMPTS, SamplingParams()), "params must be a BeamSearchParams"),
    (lambda llm, p: llm.beam_search(PROMPTS, p, lora_request=object()), "lora_request=.* is not supported"),
    (lambda llm, p: llm.beam_search(PROMPTS, p, lora_request=[None]), "lora_request has 1 entries for 3 prompts"),
    (lambda llm, p: llm.beam_search(PROMPTS, p, concurrency_limit=0), "concurrency_limit must be None or an integer"),
    (lambda llm, p: llm.beam_search(["a", {"prompt": "b", "multi_modal_data": {"image": 1}}], p),
     r"prompt 2 of 2: prompt dict has unsupported key\(s\) \['multi_modal_data'\].*text-only"),
    (lambda llm, p: llm.beam_search(["a", [1, 10**6]], p), r"prompt 2 of 2: prompt token ids must be integers in"),
    (lambda llm, p: llm.beam_search(["a", [1] * 128], p), "prompt 2 of 2: prompt has 128 tokens, which leaves no room"),
])
def test_beam_search_names_a_bad_argument_and_queues_nothing(llm, call, needle):
    with pytest.raises(ValueError, match=needle):
        call(llm, BeamSearchParams(beam_width=2, max_tokens=3))
    assert not llm.llm_engine.has_unfinished_requests()


def test_beam_search_is_an_llm_method_again(llm):
    """hasattr() was False (the method was refused as vLLM's and missing)."""
    assert hasattr(llm, "beam_search")


def test_no_prompts_search_nothing_and_sampling_params_point_at_beam_search(llm):
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=3)) == []
    with pytest.raises(ValueError, match="use_beam_search=True is not supported: .*LLM.beam_search takes a "
                                         "BeamSearchParams"):
        SamplingParams(use_beam_search=True)


def test_beam_width_is_bounded_by_the_engines_max_logprobs(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=32, max_logprobs=4) as small:
        with pytest.raises(ValueError, match=r"beam_width must be at most max_logprobs // 2 \(2\).*got 3"):
            small.beam_search(["Once"], BeamSearchParams(beam_width=3, max_tokens=2))
        [out] = small.beam_search(["Once"], BeamSearchParams(beam_width=2, max_tokens=2))
        assert len(out.sequences) == 2


# ---- LLM(disable_log_stats=False).get_metrics(): vLLM's offline metrics example was refused at LLM() --------

@pytest.fixture(scope="module")
def metrics_llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128, disable_log_stats=False) as model:
        yield model


def _by_name(metrics, name, **labels):
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_get_metrics_counts_what_generate_did_as_vllms_metrics_example_reads_them(metrics_llm, llm):
    from minillm.metrics_reader import Counter, Gauge, Histogram
    params = SamplingParams(temperature=0, max_tokens=5)
    outputs = metrics_llm.generate(PROMPTS, params, use_tqdm=False)
    # the outputs are those of an LLM without metrics (whose requests report only when they finish)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    metrics = metrics_llm.get_metrics()
    name = str(metrics_llm.llm_engine.config.model)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    assert _by_name(metrics, "minillm:generation_tokens") == Counter("minillm:generation_tokens",
                                                                     {"model_name": name}, 15)
    assert _by_name(metrics, "minillm:prompt_tokens").value == num_prompt
    assert _by_name(metrics, "minillm:request_success", finished_reason="length").value == 3
    assert _by_name(metrics, "minillm:num_requests_running") == Gauge("minillm:num_requests_running",
                                                                      {"model_name": name}, 0.0)
    for hist_name, count in [("minillm:time_to_first_token_seconds", 3), ("minillm:inter_token_latency_seconds", 12),
                             ("minillm:request_generation_tokens", 3)]:
        hist = _by_name(metrics, hist_name)
        assert isinstance(hist, Histogram) and "le" not in hist.labels
        assert hist.count == count and hist.buckets["+Inf"] == count
        assert list(hist.buckets.values()) == sorted(hist.buckets.values())    # cumulative, as Prometheus'
    assert _by_name(metrics, "minillm:request_generation_tokens").sum == 15.0
    assert _by_name(metrics, "minillm:request_prompt_tokens").sum == num_prompt


def test_get_metrics_without_disable_log_stats_false_is_vllms_assertion(llm):
    with pytest.raises(AssertionError, match=r"Stat logging disabled: .*disable_log_stats=False"):
        llm.get_metrics()


def test_metrics_snapshot_reads_vectors_summaries_and_keeps_other_prefixes_out():
    from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge as PromGauge, Summary

    from minillm.metrics_reader import Histogram, Vector, metrics_snapshot
    registry = CollectorRegistry()
    per_pos = PromCounter("minillm:spec_decode_num_accepted_tokens_per_pos", "x", ["model_name", "position"],
                          registry=registry)
    per_pos.labels("m", "0").inc(7)
    per_pos.labels("m", "2").inc(2)
    Summary("minillm:compile_seconds", "x", registry=registry).observe(0.25)
    PromGauge("other:gauge", "x", registry=registry).set(1)
    metrics = metrics_snapshot(registry)
    assert Vector("minillm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [7, 0, 2]) in metrics
    assert Histogram("minillm:compile_seconds", {}, 1, 0.25, {"+Inf": 1}) in metrics
    assert not [m for m in metrics if m.name.startswith("other:")]


# ---- reset_prefix_cache takes vLLM's arguments (it was a TypeError for either) -------------------------

def test_reset_prefix_cache_takes_vllms_arguments_and_forgets_the_prompts(llm):
    prompt = {"prompt_token_ids": list(range(3, 60))}       # 57 tokens: three full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.reset_prefix_cache(True) is True
    with pytest.raises(ValueError, match="reset_connector must be true or false, got 'yes'"):
        llm.reset_prefix_cache(reset_connector="yes")


def test_an_encoder_decoder_prompt_says_the_model_is_decoder_only(llm):
    """vLLM's ExplicitEncoderDecoderPrompt: the keys were named without a reason."""
    with pytest.raises(ValueError, match=r"\['decoder_prompt', 'encoder_prompt'\].*decoder_prompt: minillm runs "
                                         r"decoder-only models, which take no encoder-decoder prompt"):
        llm.generate({"encoder_prompt": "Once", "decoder_prompt": "upon"}, SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_supported_tasks_is_generate_as_vllm_reports_a_generative_model(llm):
    """vLLM scripts check `"generate" in llm.supported_tasks` before calling generate (an AttributeError here)."""
    assert llm.supported_tasks == ("generate",)


# ---- minillm bench latency --use-beam-search times LLM.beam_search, as vllm bench latency does ----------

def test_bench_latency_use_beam_search_times_beam_search_batches(capsys, stories_path, monkeypatch):
    """It was a usage error: 'minillm has no beam search'."""
    from test_cli import run_main
    seen, beam_search = [], LLM.beam_search

    def recording(self, prompts, params, *args, **kwargs):
        outs = beam_search(self, prompts, params, *args, **kwargs)
        seen.append((prompts, params, outs))
        return outs

    monkeypatch.setattr(LLM, "beam_search", recording)
    status, out, err = run_main(capsys, "bench", "latency", "--model", str(stories_path), "--device", "cpu",
                                "--input-len", "3", "--output-len", "4", "--batch-size", "2", "--n", "3",
                                "--num-iters-warmup", "1", "--num-iters", "2", "--use-beam-search")
    assert status == 0, err
    assert "3 beam(s) of 4 tokens each" in out and "Avg latency:" in out
    assert len(seen) == 1 + 2
    for prompts, params, outs in seen:
        assert len(prompts) == 2 and (params.beam_width, params.max_tokens, params.ignore_eos) == (3, 4, True)
        assert [[len(s.tokens) for s in o.sequences] for o in outs] == [[3 + 4] * 3] * 2
