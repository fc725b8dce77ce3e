"""The scheduler's update of a step without drafts decides its rows' stops for the batch at once.

Each case runs the same scripted tokens through the batch decision (Scheduler._update_one_token_rows)
and through the per-row path (every row through _append_tokens and check_stop): the sequences' tokens,
statuses, stop reasons, penalty counts, cached blocks, the tokens reported and the order of the reports
are equal, and each stop rule gives what it gives alone. On stories260K, requests under every stop
rule and a grammar that completes give the same outputs both ways, sync and async with the grammar
process (whose clean answers settle the constrained rows in one call).
"""
import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.block_manager import BlockManager
from minillm.repetition import RepetitionDetectionParams
from minillm.sampling_params import StructuredOutputsParams
from minillm.scheduler import Scheduler, StepOutput, _settled_first
from minillm.sequence import Sequence, SequenceStatus
from minillm.structured_output import StructuredOutputRequest

EOS = 0
MAX_MODEL_LEN = 16
PROMPT_LEN = 5


def per_row_update(self, out, step, on_token, answers_pending, appended):
    """The update without the batch decision: every row through the stop rules one token at a time."""
    seqs = _settled_first(out) if answers_pending else out.sampling_seqs
    for seq in seqs:
        if seq.num_output_placeholders:
            self._append_tokens(seq, step.sampled[seq.seq_id], on_token, appended)
    return True


def create_seq(rid, params):
    prompt = [1 + (i % 50) for i in range(PROMPT_LEN)]
    max_tokens = params.max_tokens if params.max_tokens is not None else MAX_MODEL_LEN - PROMPT_LEN
    return Sequence(rid, 0, prompt, params, 0.0, np.random.default_rng(0), max_tokens)


def run(cases, stop_strings=None, abort=None):
    """Step the cases' sequences through their scripted tokens (cases: rid -> (params, tokens by step));
    stop_strings: {(rid, step): string} that on_token returns; abort: {step: rid} finished after the launch.
    Returns what each sequence ended as, the tokens appended and the reports, in order."""
    sched = Scheduler(BlockManager(64, 4, True), 16, 64, MAX_MODEL_LEN, [EOS])
    seqs = {rid: create_seq(rid, params) for rid, (params, _) in cases.items()}
    for seq in seqs.values():
        sched.add(seq)
    appended, reports = [], []
    for step in range(MAX_MODEL_LEN):
        out = sched.schedule()
        if out.is_empty:
            break
        if abort and step in abort:
            sched.finish(seqs[abort[step]], SequenceStatus.FINISHED_ABORTED)
        steps = {s.request_id: len(s.token_ids) - PROMPT_LEN for s in out.sampling_seqs}
        sampled = {s.seq_id: [cases[s.request_id][1][steps[s.request_id]]] for s in out.sampling_seqs}

        def on_token(seq, i, step=step):
            reports.append((seq.request_id, i, seq.token_ids[-1], seq.status.name))
            return (stop_strings or {}).get((seq.request_id, step))
        appended += [(s.request_id, t) for s, t in sched.update_from_output(out, StepOutput(sampled), on_token)]
        reports.append({rid: len(s.block_hashes) for rid, s in seqs.items()})     # the full blocks cached
    ends = {rid: (s.token_ids[PROMPT_LEN:], s.status, s.stop_reason, dict(s.output_counts), len(s.block_hashes))
            for rid, s in seqs.items()}
    return ends, appended, reports


def both_ways(monkeypatch, cases, **kw):
    fast = run(cases, **kw)
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_update_one_token_rows", per_row_update)
        slow = run(cases, **kw)
    assert fast == slow
    assert max(step["b" if "b" in cases else "plain"] for step in fast[2] if isinstance(step, dict)) >= 2
    return fast[0]


def tokens(*ids, then=7):
    return list(ids) + [then] * MAX_MODEL_LEN


def test_every_stop_rule_decided_for_the_batch_as_row_by_row(monkeypatch):
    cases = {
        "plain": (SamplingParams(max_tokens=6), tokens()),
        "eos": (SamplingParams(max_tokens=8), tokens(7, 7, EOS)),
        "eos_under_min_tokens": (SamplingParams(max_tokens=8, min_tokens=3), tokens(EOS, EOS, EOS, 7)),
        "stop_id_with_max_tokens": (SamplingParams(max_tokens=3, stop_token_ids=[9]), tokens(7, 7, 9)),
        "eos_with_max_tokens": (SamplingParams(max_tokens=3), tokens(7, 7, EOS)),
        "stop_id_under_min_tokens": (SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9]),
                                     tokens(9, 7, 9)),
        "max_model_len": (SamplingParams(max_tokens=None), tokens()),
        "ignore_eos": (SamplingParams(max_tokens=5, ignore_eos=True), tokens(EOS, 7, EOS)),
        "ignore_eos_stop_id": (SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[EOS]),
                               tokens(7, EOS)),
        "others_stop_id": (SamplingParams(max_tokens=4), tokens(9, 9, 9, 9)),     # 9 stops another row only
        "penalised": (SamplingParams(max_tokens=5, presence_penalty=0.5), tokens(3, 3, EOS)),
        "repetition": (SamplingParams(max_tokens=12, repetition_detection=RepetitionDetectionParams(
            max_pattern_size=2, min_count=3)), tokens()),
    }
    ends = both_ways(monkeypatch, cases)
    stopped, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
    assert ends["plain"][:3] == ([7] * 6, length, None)
    assert ends["eos"][:3] == ([7, 7, EOS], stopped, None)
    assert ends["eos_under_min_tokens"][:3] == ([EOS] * 3, stopped, None)
    assert ends["stop_id_with_max_tokens"][:3] == ([7, 7, 9], stopped, 9)   # the stop token, not the length
    assert ends["eos_with_max_tokens"][:3] == ([7, 7, EOS], stopped, None)
    assert ends["stop_id_under_min_tokens"][:3] == ([9, 7, 9], stopped, 9)
    assert ends["max_model_len"][:3] == ([7] * (MAX_MODEL_LEN - PROMPT_LEN), length, None)
    assert ends["ignore_eos"][:3] == ([EOS, 7, EOS, 7, 7], length, None)
    assert ends["ignore_eos_stop_id"][:3] == ([7, EOS], stopped, EOS)
    assert ends["others_stop_id"][:3] == ([9] * 4, length, None)
    assert ends["penalised"][:4] == ([3, 3, EOS], stopped, None, {3: 2, EOS: 1})
    assert ends["repetition"][1] is SequenceStatus.FINISHED_REPETITION


def test_a_stop_string_and_an_abort_on_the_batch_path_as_row_by_row(monkeypatch):
    cases = {
        "a": (SamplingParams(max_tokens=10), tokens()),
        "b": (SamplingParams(max_tokens=10), tokens()),
        "c": (SamplingParams(max_tokens=10), tokens()),
        "d": (SamplingParams(max_tokens=3), tokens(7, 7, 7)),
    }
    # a's text completes a stop string at its 5th token (step 4), in the step d reaches max_tokens;
    # c is aborted after its 3rd step is launched: that step's token is dropped.
    ends = both_ways(monkeypatch, cases, stop_strings={("a", 4): "x", ("d", 2): "y"}, abort={3: "c"})
    assert ends["a"][:3] == ([7] * 5, SequenceStatus.FINISHED_STOPPED, "x")
    assert ends["d"][:3] == ([7] * 3, SequenceStatus.FINISHED_STOPPED, "y")      # the stop string over the length
    assert ends["c"][:2] == ([7] * 3, SequenceStatus.FINISHED_ABORTED)
    assert ends["b"][:2] == ([7] * 10, SequenceStatus.FINISHED_LENGTH)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def stop_rule_batch(golden):
    p = [1] + golden[1:12]         # greedy: golden[12:] follows
    return [
        (p, dict(temperature=0, max_tokens=30, stop_token_ids=[golden[15]])),
        (p, dict(temperature=0, max_tokens=4, stop_token_ids=[golden[15]])),          # both in one step
        (p, dict(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[golden[13], golden[19]])),
        (p, dict(temperature=0, max_tokens=None)),                                     # to max_model_len
        (p, dict(temperature=0.9, seed=7, max_tokens=25, ignore_eos=True)),
        (p, dict(temperature=0, max_tokens=30, stop=[" the"])),
        (p, dict(temperature=0.7, seed=2, max_tokens=30, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe"]))),                                          # the grammar completes
        (p, dict(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        (p, dict(temperature=0.8, seed=5, max_tokens=12, logprobs=2, n=2)),
    ]


def both_paths_on_stories(stories_path, monkeypatch, engine_args: dict, answers_late: bool = False):
    """The stop-rule batch on stories260K through the batch decision and through the per-row path:
    (golden ids, batch, outputs of each way, rows settled a call, rows settled after a read of an
    answer still coming). answers_late: every constrained row's answer is taken as not yet read."""
    import json
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    batch = stop_rule_batch(golden)
    settled, waited = [], []
    settle = StructuredOutputRequest.settle_clean

    def counted(requests, token_ids, wait=False):
        done = settle(requests, token_ids, wait=wait)
        (waited if wait else settled).append(len(done))
        return done

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch],
                            [SamplingParams(**fields) for _, fields in batch], use_tqdm=False)
        return [[(tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                  None if c.logprobs is None else [[(t, v.rank) for t, v in d.items()] for d in c.logprobs])
                 for c in out.outputs] for out in outs]

    with LLM(str(stories_path), device="cpu", max_model_len=64, **engine_args) as llm:
        # The grammars compiled first, so that both ways run their constrained rows from the start
        # whatever a compile takes (a first one starts the grammar check process).
        warm = [(p, {**fields, "max_tokens": 1}) for p, fields in batch if "structured_outputs" in fields]
        llm.generate([{"prompt_token_ids": p} for p, _ in warm], [SamplingParams(**f) for _, f in warm],
                     use_tqdm=False)
        if answers_late:
            monkeypatch.setattr(StructuredOutputRequest, "is_settled", property(lambda self: not self._advanced))
        monkeypatch.setattr(StructuredOutputRequest, "settle_clean", staticmethod(counted))
        fast = generate(llm)
        with monkeypatch.context() as m:
            m.setattr(Scheduler, "_update_one_token_rows", per_row_update)
            slow = generate(llm)
    return golden, batch, fast, slow, settled, waited


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": True, "grammar_process": True}],
                         ids=["sync", "async-grammar-process"])
def test_requests_under_every_stop_rule_give_the_same_outputs_both_ways(stories_path, monkeypatch, engine_args):
    golden, batch, fast, slow, settled, waited = both_paths_on_stories(stories_path, monkeypatch, engine_args)
    assert fast == slow
    reasons = [c[2:4] for out in fast for c in out]
    assert ("stop", golden[15]) in reasons and ("length", None) in reasons
    assert fast[6][0][1] in ("yes", "no", "maybe") and fast[6][0][2] == "stop"      # the grammar ended it
    assert len(fast[3][0][0]) == 64 - len(batch[3][0])
    if engine_args:
        assert sum(settled) + sum(waited) > 0    # the grammar process's clean answers settled rows in one call


def test_rows_whose_answer_is_still_coming_settle_after_one_read(stories_path, monkeypatch):
    """With every constrained row's grammar-process answer taken as not yet read at the update (as on
    a GPU host, where the update starts before the answer of the step's advance is in), the answer is
    read once and its clean rows still settle in one call; outputs equal the per-row path's."""
    # An update reads an answer only for rows whose advance ran ahead of it, which the mask thread
    # does on most runs but not on every one of a loaded machine: a run without one is run again.
    for _ in range(5):
        *_, fast, slow, _, waited = both_paths_on_stories(
            stories_path, monkeypatch, {"async_scheduling": True, "grammar_process": True}, answers_late=True)
        assert fast == slow
        if sum(waited) > 0:
            break
    assert sum(waited) > 0          # rows settled after the one read of their answer
