"""N-gram speculation for constrained requests (stories260K, CPU): drafts held to the grammar.

A constrained sequence's drafts are cut before the first token its grammar refuses (and before the end
of its thinking while it reasons); the verification masks each position with the grammar after the
drafts before it; the matcher only ever takes the tokens the sequence gets. Outputs are the plain
engine's for JSON schema, regex, choice, Lark and GBNF constraints, greedy and seeded, beside
unconstrained requests, with async scheduling on and off, with the matchers in a grammar process,
under preemption, where the grammar completes inside a verified run, and after reasoning.
"""
import json

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm import structured_output as so
from minillm.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
JSONISH = '{"name": "Lily and Tom went to the park", "age": 3}'


@pytest.fixture(scope="module")
def golden(stories_path) -> list[int]:
    return json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def kinds(golden, tok) -> dict[str, tuple[list[int], StructuredOutputsParams]]:
    """A prompt whose n-gram drafts the constraint takes in part, per kind of constraint."""
    repeat = [1] + golden[1:30] + golden[1:8]
    once = [1] + golden[1:10] * 3
    return {
        "json": ([1] + enc(tok, JSONISH) * 3, StructuredOutputsParams(json=SCHEMA)),
        "regex": (repeat, StructuredOutputsParams(regex="( [a-z]+){1,12}\\.")),
        "choice": ([1] + enc(tok, " Lily was sad. Once upon a time") * 2,
                   StructuredOutputsParams(choice=[" Lily was sad", " Once upon a time there was a girl"])),
        "lark": (repeat, StructuredOutputsParams(grammar='start: WORD+ "."\nWORD: /( [a-z]+)/')),
        "gbnf": (once, StructuredOutputsParams(grammar='root ::= " Once upon a time" (" Once upon a time")*')),
    }


def outcome(c) -> tuple:
    ranks = None if c.logprobs is None else [[(t, v.rank) for t, v in d.items()] for d in c.logprobs]
    return tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason, ranks


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert [outcome(c) for c in g.outputs] == [outcome(c) for c in w.outputs], w.request_id
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is not None:
                np.testing.assert_allclose([float(v) for d in gc.logprobs for v in d.values()],
                                           [float(v) for d in wc.logprobs for v in d.values()], rtol=1e-4, atol=1e-4)


class Watch:
    """Counts what the verification did for constrained sequences, and what the grammar cut."""

    def __init__(self, llm: LLM, monkeypatch, check_matchers: bool = False):
        self.drafted = self.accepted = self.rejected_steps = self.cut = self.checked = 0
        self.multi_token_ends = 0        # constrained sequences finished by a step that gave several tokens
        scheduler = llm.engine.scheduler
        update = scheduler.update_from_output

        def watched_update(out, step, *args, **kwargs):
            spec = out.scheduled_spec_decode_tokens
            live = [s for s in out.sampling_seqs if s.num_output_placeholders]
            appended = update(out, step, *args, **kwargs)
            for seq in live:
                if seq.structured_output is None:
                    continue
                drafts = spec.get(seq.seq_id, [])
                accepted = step.num_accepted_tokens.get(seq.seq_id, 0)
                self.drafted += len(drafts)
                self.accepted += accepted
                self.rejected_steps += accepted < len(drafts)
                self.multi_token_ends += seq.is_finished and len(step.sampled[seq.seq_id]) > 1
                if check_matchers and not seq.is_finished:
                    self.check_matcher(seq)
            return appended
        monkeypatch.setattr(scheduler, "update_from_output", watched_update)
        validate = so.validate_drafts

        def watched_validate(requests, drafts):
            valid = validate(requests, drafts)
            self.cut += sum(len(d) - len(v) for d, v in zip(drafts, valid))
            return valid
        monkeypatch.setattr(so, "validate_drafts", watched_validate)

    def check_matcher(self, seq) -> None:
        """The matcher holds exactly the sequence's outputs: its next mask is a fresh matcher's after them."""
        request = seq.structured_output
        outputs = seq.output_token_ids
        assert request.num_advanced == 0 and request.matcher.num_accepted == len(outputs)
        fresh = request.grammar.result().new_matcher()
        assert fresh.accept_tokens(outputs)
        masks = so.allocate_token_bitmask(2, 512)
        llg = [request.matcher._matcher, fresh._matcher]
        so.fill_rows(lambda: None, [(llg[0], 0)], masks)
        so.fill_rows(lambda: None, [(llg[1], 1)], masks)
        np.testing.assert_array_equal(masks[0], masks[1])
        self.checked += 1


def mixed_requests(golden, kinds) -> tuple[list, list]:
    """Every kind greedy (with logprobs) and seeded, and two unconstrained drafting requests."""
    prompts, params = [], []
    for i, (prompt, structured) in enumerate(kinds.values()):
        prompts += [prompt, prompt]
        params += [SamplingParams(temperature=0, max_tokens=40, logprobs=2, structured_outputs=structured),
                   SamplingParams(temperature=0.8, seed=i, max_tokens=40, structured_outputs=structured)]
    prompts += [[1] + golden[1:30] + golden[1:8], [1] + golden[60:70] * 3]
    params += [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
               SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True)]
    return prompts, params


# ---- the pieces -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager(tok):
    mgr = so.StructuredOutputManager.from_tokenizer(tok, 512, max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def test_draft_rows_are_the_masks_after_each_draft_and_the_matcher_stays(manager, tok):
    compiled = manager.grammar_init(StructuredOutputsParams(grammar='start: (" Once upon a time")+ "."')).result()
    once = enc(tok, "Once upon a time")
    matcher = compiled.new_matcher()
    assert matcher.accept_tokens(once[:2])
    before = so.allocate_token_bitmask(1, 512)
    manager.fill_bitmask([matcher], [0], before)
    drafts = once[2:] + once + [EOS]                     # valid up to the EOS, which the grammar refuses here
    other = compiled.new_matcher()
    out = np.zeros((2 + len(drafts) + 1, 16), np.int32)
    so.fill_draft_rows(manager._fill_executor, [(other._matcher, 0, []), (matcher._matcher, 1, drafts)], out)
    walk = compiled.new_matcher()
    want = so.allocate_token_bitmask(len(drafts) + 1, 512)
    assert walk.accept_tokens(once[:2])
    for j in range(len(drafts)):                        # the mask before each draft, up to the refused one
        manager.fill_bitmask([walk], [j], want)
        if not walk.accept_token(drafts[j]):
            break
    refused = len(drafts) - 1                           # the EOS: its row is the last one filled
    np.testing.assert_array_equal(out[1:1 + refused + 1], want[:refused + 1])
    assert (out[1 + refused + 1] == -1).all()           # past the refused draft: never read
    manager.fill_bitmask([compiled.new_matcher()], [0], want)
    np.testing.assert_array_equal(out[0], want[0])                  # a row without drafts: its own mask
    after = so.allocate_token_bitmask(1, 512)
    manager.fill_bitmask([matcher], [0], after)
    assert matcher.num_accepted == 2 and not matcher.is_stopped()
    np.testing.assert_array_equal(before, after)
    # the scheduler's cut: the drafts before the refused one
    request = so.StructuredOutputRequest(manager.grammar_init(StructuredOutputsParams(
        grammar='start: (" Once upon a time")+ "."')))
    request.grammar.result()
    assert request.is_ready and request.matcher.accept_tokens(once[:2])
    assert so.validate_drafts([request], [drafts]) == [drafts[:refused]]
    assert request.matcher.num_accepted == 2


def test_a_sequence_still_thinking_keeps_its_drafts_up_to_the_end_of_thinking(manager, tok):
    end = 511
    params = StructuredOutputsParams(regex="( [a-z]+)+")
    thinking = so.StructuredOutputRequest(manager.grammar_init(params), reasoning_end_id=end)
    held = so.StructuredOutputRequest(manager.grammar_init(params))
    held.grammar.result()
    assert thinking.is_ready and held.is_ready
    words, caps = enc(tok, "once upon"), enc(tok, "Once upon")
    assert so.validate_drafts([thinking, held, held], [caps + [end] + words, caps + words, words + caps]) == \
        [caps, [], words]
    thinking.advance(caps + [end])                      # its thinking ends: the grammar holds it from here
    assert so.validate_drafts([thinking], [words + caps]) == [words]


# ---- the engine -----------------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_requests_draft_and_give_the_plain_outputs(stories_path, golden, kinds, async_scheduling,
                                                               monkeypatch):
    prompts, params = mixed_requests(golden, kinds)
    want = LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=async_scheduling)
    # the matchers are compared with fresh ones between steps (with async scheduling a fill may be running then)
    watch = Watch(llm, monkeypatch, check_matchers=not async_scheduling)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    assert watch.accepted > 10 and watch.rejected_steps > 0 and watch.cut > 0
    assert watch.checked > 10 or async_scheduling
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_json_request_alone_accepts_drafts(stories_path, kinds):
    prompt, structured = kinds["json"]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
    want = LLM(str(stories_path), device="cpu").generate([prompt], params, use_tqdm=False)
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC)
    got = llm.generate([prompt], params, use_tqdm=False)
    assert_same(got, want)
    assert got[0].outputs[0].text.startswith('{"name":"')
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 5


def test_matchers_in_a_grammar_process_draft_alike(stories_path, golden, kinds, monkeypatch):
    prompts, params = mixed_requests(golden, kinds)
    want = LLM(str(stories_path), device="cpu").generate(prompts, params, use_tqdm=False)
    with LLM(str(stories_path), device="cpu", grammar_process=True, async_scheduling=True,
             speculative_config=SPEC) as llm:
        watch = Watch(llm, monkeypatch)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    assert watch.accepted > 10 and watch.rejected_steps > 0 and watch.cut > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_keeps_the_plain_outputs(stories_path, golden, kinds, async_scheduling, monkeypatch):
    prompts, params = mixed_requests(golden, kinds)
    kw = dict(device="cpu", block_size=4, num_kv_blocks=40, max_model_len=128, async_scheduling=async_scheduling)
    want = LLM(str(stories_path), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(stories_path), speculative_config=SPEC, **kw)
    watch = Watch(llm, monkeypatch)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    assert llm.engine.stats().num_preemptions > 0 and watch.accepted > 10
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("grammar_process", [False, True])
def test_a_grammar_completed_inside_a_verified_run_ends_where_the_plain_output_does(stories_path, golden, tok,
                                                                                    grammar_process, monkeypatch):
    """The regex ends at '.', sampled after accepted drafts; the choice ends at ' time', a draft followed by EOS
    in the prompt's copy of it (EOS is all the grammar allows after it). The stop rules read the grammar as
    of each token, not as of the last one the matcher took."""
    repeat = [1] + golden[1:30] + golden[1:8]
    choice = [1] + enc(tok, " Once upon a time") + [EOS] + enc(tok, " Lily. Once upon")
    requests = [(repeat, dict(regex="( [a-z]+){1,12}\\.")),
                (choice, dict(choice=[" Once upon a time", " Lily was sad"]))]
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(**c))
              for _, c in requests]
    want = LLM(str(stories_path), device="cpu").generate(prompts, params, use_tqdm=False)
    with LLM(str(stories_path), device="cpu", grammar_process=grammar_process, speculative_config=SPEC) as llm:
        watch = Watch(llm, monkeypatch)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    assert [o.outputs[0].text for o in got] == [" a little girl named outside.", " Once upon a time"]
    assert watch.multi_token_ends == 2


def test_drafts_of_a_thinking_sequence_stop_before_the_end_of_thinking(stories_path, golden, tok, tmp_path,
                                                                      monkeypatch):
    """A prompt that thought, closed its thinking and wrote the JSON, then thinks again: drafts copy the
    thinking up to </think> (cut there) and the JSON after it (held to the schema)."""
    from test_abuse34_parsers import model_with_added_tokens
    think, end = 510, 511
    model = model_with_added_tokens(stories_path, tmp_path / "thinking", {think: "<think>", end: "</think>"}, False)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    story = golden[1:12]
    prompt = [1, think] + story + [end] + enc(tok, '{"a":true,"b":"x"}') + [think] + story[:8]
    params = [SamplingParams(temperature=t, seed=2, max_tokens=60, logit_bias={end: 22.0},
                             structured_outputs=StructuredOutputsParams(json=schema, reasoning=(think, end)))
              for t in (0, 1.0)]
    want = LLM(str(model), device="cpu").generate([prompt] * 2, params, use_tqdm=False)
    llm = LLM(str(model), device="cpu", speculative_config=SPEC)
    seen = []
    validate = so.validate_drafts
    monkeypatch.setattr(so, "validate_drafts", lambda r, d: seen.append((d, validate(r, d))) or seen[-1][1])
    got = llm.generate([prompt] * 2, params, use_tqdm=False)
    assert_same(got, want)
    for out in got:
        ids = out.outputs[0].token_ids
        json.loads(tok.decode(ids[ids.index(end) + 1:]))
    # a draft that crossed </think> kept what came before it; drafts after it were held to the schema
    assert any(end in d and v == d[:d.index(end)] for drafts, valid in seen for d, v in zip(drafts, valid))
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 10


def test_unconstrained_drafts_never_ask_a_grammar(stories_path, golden, monkeypatch):
    def refuse(*_):
        raise AssertionError("a grammar was asked about unconstrained drafts")
    monkeypatch.setattr(so, "validate_drafts", refuse)
    llm = LLM(str(stories_path), device="cpu", speculative_config=SPEC, async_scheduling=True)
    llm.generate([[1] + golden[1:30] + golden[1:8]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert llm.engine.structured_outputs is None
