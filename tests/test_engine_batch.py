"""semcomm.engine.BatchDecoder: queued requests decoded together by the engine's one loop.

A batch decodes like each of its requests alone (greedy, on the byte-level tiny model), with
and without KV reuse; streamed pieces join to the text with stop strings; a cancelled request
ends without stopping the others; fusion's decoding from a given cache is the same loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from semcomm.cli._quickstart import _config_built_model
from semcomm.engine import (
    BatchDecoder,
    BatchRequest,
    BatchResult,
    DecodeState,
    HFEngine,
    SamplingParams,
    StopText,
    cache_layers,
    decode_steps,
)
from semcomm.kv import MemoryStore

PROMPTS = ["List the items: item-1 item-2 item-3", "Where is parcel 5120 now?", "hi",
           "Order log: " + " ".join(f"item-{i} shipped;" for i in range(12))]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    torch.set_num_threads(1)
    model, tokenizer, _ = _config_built_model()
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(tiny: tuple[Any, Any]) -> HFEngine:
    model, tokenizer = tiny
    return HFEngine(model, tokenizer, store=MemoryStore(), chunk_size=8, device="cpu")


def _requests(tokenizer: Any, *, engine: HFEngine | None = None, stop: tuple[str, ...] = (),
              max_new: int = 20, pieces: list[list[str]] | None = None,
              cancelled: Callable[[], bool] | None = None) -> list[BatchRequest]:
    out = []
    for i, p in enumerate(PROMPTS):
        sink = pieces[i].append if pieces is not None else None
        out.append(BatchRequest(prompt_ids=list(tokenizer(p)["input_ids"]), max_new_tokens=max_new,
                                stop=stop, engine=engine, on_text=sink,
                                cancelled=cancelled if i == 0 else None))
    return out


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("stop", [(), ("\n\n\n",), ("CCC", "T\ufffdT")])
def test_a_batch_decodes_like_each_request_alone(tiny: tuple[Any, Any], engine: HFEngine,
                                                 reuse: bool, stop: tuple[str, ...]) -> None:
    model, tokenizer = tiny
    eng = engine if reuse else None
    dec = BatchDecoder.for_engine(engine) if reuse else BatchDecoder(model, tokenizer)
    alone = [engine.generate(r.prompt_ids, max_new_tokens=20, stop=list(stop) or None)
             for r in _requests(tokenizer)]
    pieces: list[list[str]] = [[] for _ in PROMPTS]
    batch = dec.generate(_requests(tokenizer, engine=eng, stop=stop, pieces=pieces))
    assert [r.batch for r in batch] == [len(PROMPTS)] * len(PROMPTS)
    for one, res, got in zip(alone, batch, pieces):
        assert res.text == one.text and res.token_ids == one.token_ids
        assert "".join(got) == res.text  # the stream contract, stop strings held back
        want = "stop" if one.stats.finish_reason in ("stop", "eos") else "length"
        assert ("stop" if res.finish_reason in ("stop", "eos") else "length") == want
        assert res.stats.ttft_s > 0 and res.stats.new_tokens == len(res.token_ids)
    if len(stop) == 2:  # both end a row mid-way
        assert [r.finish_reason for r in batch][::2] == ["stop", "stop"]


def test_engine_requests_reuse_the_cached_prefix(tiny: tuple[Any, Any], engine: HFEngine) -> None:
    _, tokenizer = tiny
    dec = BatchDecoder.for_engine(engine)
    dec.generate(_requests(tokenizer, engine=engine, max_new=2))
    started: list[int] = []
    reqs = _requests(tokenizer, engine=engine, max_new=2)
    for r in reqs:
        r.on_start = lambda st: started.append(st.hit_tokens)
    res = dec.generate(reqs)
    assert started == [r.stats.hit_tokens for r in res]
    long = len(reqs[-1].prompt_ids)
    assert res[-1].stats.hit_tokens == long  # the whole prompt, with its stored last logits
    assert res[-1].stats.logits_restored and res[-1].stats.recomputed_tokens == 0


def test_a_batch_of_one_is_the_engine_generate(tiny: tuple[Any, Any], engine: HFEngine) -> None:
    _, tokenizer = tiny
    req = _requests(tokenizer, engine=engine)[0]
    req.params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    (res,) = BatchDecoder.for_engine(engine).generate([req])
    ref = engine.generate(req.prompt_ids, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    assert res.token_ids == ref.token_ids and res.batch == 1


def test_a_cancelled_request_ends_alone(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    pieces: list[list[str]] = [[] for _ in PROMPTS]
    polls = [0]

    def cancelled() -> bool:
        polls[0] += 1
        return polls[0] > 3

    res = BatchDecoder(model, tokenizer).generate(
        _requests(tokenizer, pieces=pieces, cancelled=cancelled))
    assert res[0].finish_reason == "cancelled" and len(res[0].token_ids) == 3
    assert all(len(r.token_ids) == 20 or r.finish_reason != "cancelled" for r in res[1:])
    assert all(r.finish_reason != "cancelled" for r in res[1:])


def test_a_batch_mixing_engine_and_plain_requests_is_refused(tiny: tuple[Any, Any],
                                                              engine: HFEngine) -> None:
    model, tokenizer = tiny
    reqs = _requests(tokenizer)
    reqs[0].engine = engine
    with pytest.raises(ValueError, match="mixes"):
        BatchDecoder(model, tokenizer).generate(reqs)
    assert BatchDecoder(model, tokenizer).generate([]) == []


def test_continue_greedy_from_a_given_cache(tiny: tuple[Any, Any], engine: HFEngine) -> None:
    """Fusion's path: KV a caller computed, the last prompt token fed, greedy to the end."""
    model, tokenizer = tiny
    ids = list(tokenizer(PROMPTS[0])["input_ids"])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True)
    layers = cache_layers(out.past_key_values)
    before = [k.clone() for k, _ in layers]
    dec = BatchDecoder(model, tokenizer)
    got = list(dec.continue_greedy(layers, [ids[-1]], start_pos=len(ids) - 1, max_new_tokens=12))
    ref = engine.generate(ids, max_new_tokens=12)
    want = [t for t in ref.token_ids if t not in dec.eos_ids][:len(got)]
    assert got == want and len(got) >= 1
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, layers))  # not mutated


def test_decode_steps_releases_per_row_and_stops_each_row(tiny: tuple[Any, Any]) -> None:
    """The loop on scripted logits: each row takes the argmax, stops at its own limit."""
    _, tokenizer = tiny
    vocab = 300
    script = list(tokenizer("abcdef", add_special_tokens=False)["input_ids"])
    assert len(script) == 6

    def logits_for(step: int) -> torch.Tensor:
        t = torch.zeros((2, vocab))
        t[:, script[step]] = 1.0
        return t

    states = [DecodeState(tokenizer, SamplingParams(), torch.device("cpu"), max_new_tokens=n)
              for n in (2, 4)]
    step = [0]

    def forward(nxt: list[int]) -> torch.Tensor:
        step[0] += 1
        return logits_for(step[0])

    released = list(decode_steps(states, logits_for(0), forward, pad_id=0))
    assert len(released) == 4 and released[2][0] is None  # row 0 ended after 2 tokens
    assert [s.finish_reason for s in states] == ["length", "length"]
    texts = [tokenizer.decode(s.token_ids) for s in states]
    assert texts == ["ab", "abcd"]
    assert StopText(tokenizer).push(script[0])[0] == "a"


def test_result_type_is_the_public_one(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    (res,) = BatchDecoder(model, tokenizer).generate(_requests(tokenizer, max_new=1)[:1])
    assert isinstance(res, BatchResult) and len(res.token_ids) == 1
