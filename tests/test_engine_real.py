"""Exact KV reuse on the real catalog models: cold, warm and after a restart.

float32: greedy output with the cache is token for token the model's own ``generate`` output
(no cache involved), at prompt lengths on chunk boundaries and one token either side.

bfloat16: a restored prefix is bit for bit the KV the model computes, so the warm output is
the model's own ``generate`` output over a prefix cache of the same split (prefix computed
first, then the rest, as any prefix cache does). It is not always the output of one full
prefill: on CPU a bfloat16 matmul over 1 row and over n rows round differently, and a near
tie can flip (measured on SmolLM2: the 6th token of one prompt). The cold output is the full
prefill's. A "restart" is a new engine over a fresh memory tier and the same disk directory
(the disk store rebuilds its index by scanning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from semcomm import HFEngine
from semcomm.kv import DiskStore, MemoryStore, TieredStore
from semcomm.models import is_pulled, model_path

CHUNK = 64
NEW = 4
_TEXT = (
    "Northwind Rail support notes. Tickets are refundable up to 24 hours before departure; "
    "after that a 20 percent fee applies. Bicycles travel free outside rush hours. Pets under "
    "8 kg ride free in a carrier; larger dogs need a half-price ticket and a leash. Delays "
    "over 30 minutes earn a 25 percent refund, over 60 minutes 50 percent, claimed within 14 "
    "days with the ticket number. Season passes pause once a year for up to 30 days. Lost "
    "items are kept 90 days at the central station office. Question: my train was 70 minutes "
    "late and I had a dog of 12 kg with me; what refund do I get and what ticket did the dog "
    "need? Answer:"
)

MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


def _load(name: str) -> tuple[str, Any, Any]:
    if not is_pulled(name):
        pytest.skip(f"{name} is not pulled (`semcomm models pull {name}`)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name, pull_missing=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=MODELS)
def loaded(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    return _load(request.param)


@pytest.fixture(scope="module")
def small() -> tuple[str, Any, Any]:
    """The small model only: for the paths that are the same code on every model."""
    return _load(MODELS[0])


def _prompt(tok: Any, n: int) -> list[int]:
    ids = tok(_TEXT * 3)["input_ids"]
    assert len(ids) >= n
    return list(ids[-n:])  # ends on the question, so the continuation is text


def _reference(model: Any, ids: list[int]) -> list[int]:
    """The model's own greedy output."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _engine(model: Any, tok: Any, disk: Path, dtype: str) -> HFEngine:
    return HFEngine(model, tok, store=TieredStore([MemoryStore(), DiskStore(disk)]),
                    chunk_size=CHUNK, dtype=dtype)


# prompt lengths per (model, dtype): chunk boundaries and one token either side; fewer on the
# larger model and in bfloat16, to keep the suite's time on two cores
_LENGTHS = {
    ("smollm2-135m-instruct", "float32"): [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1],
    ("smollm2-135m-instruct", "bfloat16"): [CHUNK - 1, CHUNK + 1],
    ("qwen2.5-coder-0.5b-instruct", "float32"): [CHUNK - 1, CHUNK, CHUNK + 1],
    ("qwen2.5-coder-0.5b-instruct", "bfloat16"): [CHUNK + 1],
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_greedy_is_exact_cold_warm_and_after_restart(
    loaded: tuple[str, Any, Any], dtype: str, tmp_path: Path
) -> None:
    name, model, tok = loaded
    m = model.to(getattr(torch, dtype))
    try:
        lengths = _LENGTHS[(name, dtype)]
        cold = _engine(m, tok, tmp_path / "kv", dtype)
        warm_want = {}
        for n in lengths:
            ids = _prompt(tok, n)
            want = _reference(m, ids)
            r_cold = cold.generate(ids, max_new_tokens=NEW)
            assert r_cold.token_ids == want, (name, dtype, n, "cold")
            r_warm = cold.generate(ids, max_new_tokens=NEW)
            # the whole prompt and the logits its cold prefill computed: nothing recomputed, so
            # warm equals cold (and ``generate``) in bfloat16 too
            assert r_warm.stats.hit_tokens == n and r_warm.stats.logits_restored
            warm_want[n] = want
            assert r_warm.token_ids == warm_want[n], (name, dtype, n, "warm")
        restarted = _engine(m, tok, tmp_path / "kv", dtype)
        for n in lengths:
            ids = _prompt(tok, n)
            r = restarted.generate(ids, max_new_tokens=NEW)
            assert r.stats.hit_tokens == n and "disk" in r.stats.hit_tiers
            assert r.token_ids == warm_want[n], (name, dtype, n, "after restart")
    finally:
        model.to(torch.float32)


def test_real_chat_answer_is_exact_and_reuses_the_system_prompt(small: tuple[str, Any, Any],
                                                               tmp_path: Path) -> None:
    _, model, tok = small
    eng = _engine(model, tok, tmp_path / "kv", "float32")
    system = {"role": "system", "content": _TEXT}
    a = eng.generate([system, {"role": "user", "content": "What is the refund for 70 min?"}],
                     max_new_tokens=NEW)
    b = eng.generate([system, {"role": "user", "content": "Do bicycles travel free?"}],
                     max_new_tokens=NEW)
    assert b.stats.hit_tokens >= CHUNK  # the shared system prompt came from the cache
    assert b.token_ids == _reference(model, b.prompt_ids)
    assert a.text and any(c.isalpha() for c in a.text)
