"""The lm-eval bridge: each request kind against plain forward passes, and lm-eval end to end on
local tasks (a multiple-choice task, a perplexity task, a generation task) written by the test."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-eval bridge needs lm-eval: pip install 'linmem[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from linmem.eval.harness import HarnessError, LinmemLM, run_harness  # noqa: E402
from linmem.data.codec import byte_codec  # noqa: E402

from .conftest import MC, TEXTS, tiny_byte_model, write_local_tasks  # noqa: E402

CODEC = byte_codec()


def _request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@torch.no_grad()
def _logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logp = model(ids, use_cache=False).logits[0, :-1].log_softmax(-1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(float(logp[t, ids[0, t + 1]]) for t in positions)


def test_loglikelihood_matches_a_forward_pass_batched_or_not():
    model = tiny_byte_model()
    pairs = [("The cat", " sat"), ("", "hello"), ("a much longer context than the others", " x"), ("ab", "cdef")]
    lm = LinmemLM(model, CODEC, batch_size=3, max_length=64)
    got = lm.loglikelihood([_request("loglikelihood", c, x) for c, x in pairs], disable_tqdm=True)
    one = LinmemLM(model, CODEC, batch_size=1, max_length=64).loglikelihood(
        [_request("loglikelihood", c, x) for c, x in pairs], disable_tqdm=True)
    for (context, continuation), (logprob, greedy), (alone, _) in zip(pairs, got, one):
        ctx = CODEC.encode(context) or [CODEC.prefix_token_id]
        assert logprob == pytest.approx(_logprob(model, ctx, CODEC.encode(continuation)), abs=1e-4)
        assert logprob == pytest.approx(alone, abs=1e-4) and isinstance(greedy, bool)


def test_rolling_loglikelihood_scores_every_token_once():
    model = tiny_byte_model()
    text = "def area(width, height):\n    return width * height\n" * 2
    tokens = CODEC.encode(text)
    whole = LinmemLM(model, CODEC, max_length=256).loglikelihood_rolling([_request("loglikelihood_rolling", text)],
                                                                        disable_tqdm=True)
    assert whole[0] == pytest.approx(_logprob(model, [CODEC.prefix_token_id], tokens), abs=1e-3)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, CODEC.prefix_token_id, 32, 1)))
    assert sum(len(w) for _, w in windows) == len(tokens)
    small = LinmemLM(model, CODEC, max_length=32, max_gen_toks=8, batch_size=4).loglikelihood_rolling(
        [_request("loglikelihood_rolling", text)], disable_tqdm=True)
    assert small[0] == pytest.approx(sum(_logprob(model, c, w) for c, w in windows), abs=1e-3)


def test_generate_until_is_greedy_and_cut_at_the_stop_string():
    model = tiny_byte_model()
    lm = LinmemLM(model, CODEC, batch_size=2, max_length=64, max_gen_toks=6)
    contexts = ["x = 1\n", "hello", "def f("]
    with torch.no_grad():
        expected = []
        for context in contexts:
            seq = CODEC.encode(context)
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            expected.append(CODEC.decode(seq[len(CODEC.encode(context)):]))
    plain = lm.generate_until([_request("generate_until", c, {"until": []}) for c in contexts], disable_tqdm=True)
    assert plain == expected
    stop = expected[0][2]
    cut = lm.generate_until([_request("generate_until", contexts[0], {"until": [stop]})], disable_tqdm=True)
    assert cut == [expected[0].split(stop, 1)[0]]
    with pytest.raises(HarnessError, match="greedily"):
        lm.generate_until([_request("generate_until", "a", {"do_sample": True, "temperature": 0.7})])


def test_the_model_is_registered_and_checks_its_settings():
    assert get_model("linmem") is LinmemLM
    with pytest.raises(HarnessError, match="run_dir"):
        LinmemLM.create_from_arg_string("batch_size=4")
    with pytest.raises(HarnessError, match="max_gen_toks"):
        LinmemLM(tiny_byte_model(), CODEC, max_length=16, max_gen_toks=16)


def test_lm_eval_runs_local_tasks_end_to_end(tmp_path):
    model = tiny_byte_model()
    lm = LinmemLM(model, CODEC, batch_size=8, max_length=128, max_gen_toks=8)
    out = run_harness(None, ["toy_choice", "toy_perplexity", "toy_generation"],
                      include_path=write_local_tasks(tmp_path), lm=lm, bootstrap_iters=0, include_defaults=False)
    results = out["results"]
    picks = [max(range(3), key=lambda j: _logprob(model, CODEC.encode(r["question"]), CODEC.encode(r["choices"][j])))
             for r in MC]
    assert results["toy_choice"]["acc,none"] == pytest.approx(sum(p == r["answer"] for p, r in zip(picks, MC)) / 10)
    total = sum(_logprob(model, [CODEC.prefix_token_id], CODEC.encode(r["text"])) for r in TEXTS)
    words = sum(len(r["text"].split()) for r in TEXTS)
    assert results["toy_perplexity"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-3)
    assert 0.0 <= results["toy_generation"]["exact_match,none"] <= 1.0
    assert out["n-samples"]["toy_choice"]["effective"] == 10
    with pytest.raises(HarnessError, match="knows no task"):
        run_harness(None, ["no_such_task"], include_path=tmp_path, lm=lm, include_defaults=False)
