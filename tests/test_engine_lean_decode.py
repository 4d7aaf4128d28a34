"""The lean decode step (engine/_lean_decode.py): the model's own operations without its per-call
machinery; hidden states bit for bit those of the model's forward, tokens equal ``generate``."""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.engine import _cache_adapter as ca
from semcomm.engine._lean_decode import LeanDecoder
from semcomm.kv import MemoryStore

from ._engine_models import prompt_ids, reference_greedy, tiny_model

LEAN = ["llama", "mistral", "qwen2"]


def generate_cached(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """``model.generate``'s greedy tokens with its default (dynamic) cache: in bfloat16 the
    reference for a cached decode (a recomputed prefix rounds differently there)."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,  # type: ignore[operator]
                         do_sample=False, pad_token_id=0)
    return list(out[0, len(ids):].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", LEAN)
def test_lean_steps_equal_the_models_forward_bit_for_bit(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family).to(dtype)
    runner = ca.ModelRunner(model)
    lean = LeanDecoder.build(model, runner.base_model())
    assert lean is not None
    layout = ca.probe_layout(model, torch.device("cpu"))
    ids = torch.tensor([prompt_ids(60)])
    with torch.inference_mode():
        a = ca.buffer_cache(layout, 64, torch.device("cpu"))
        runner.forward(ids[:, :40], a)
        b = ca.copy_cache(a)
        for i in range(40, 60):
            tok = ids[:, i : i + 1]
            assert torch.equal(runner.hidden(tok, a), lean.hidden(tok, b)), i
        for (ka, va), (kb, vb) in zip(ca.layer_tensors(a), ca.layer_tensors(b)):
            assert torch.equal(ka, kb) and torch.equal(va, vb)  # the same K/V written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", LEAN)
def test_engine_decodes_through_it_and_equals_generate(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family).to(dtype)
    ids = prompt_ids(45)
    ref = generate_cached(model, ids, 24)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=16, device="cpu")
    assert engine.generate(ids, max_new_tokens=24).token_ids == ref  # cold
    assert engine.generate(ids, max_new_tokens=24).token_ids == ref  # warm
    assert engine._lean_decoder() is not None  # the steps ran through the lean decoder
    off = HFEngine(model, device="cpu", lean_decode=False)
    assert off.generate(ids, max_new_tokens=24).token_ids == ref
    assert off._lean_decoder() is None


@pytest.mark.parametrize("family", ["gemma", "gpt2", "phi3"])
def test_other_families_keep_the_models_forward(family: str) -> None:
    model = tiny_model(family)
    assert LeanDecoder.build(model, ca.ModelRunner(model).base_model()) is None
    ids = prompt_ids(30)
    engine = HFEngine(model, device="cpu")
    assert engine.generate(ids, max_new_tokens=8).token_ids == reference_greedy(model, ids, 8)
    assert engine._lean_decoder() is None


def test_sliding_window_models_keep_the_models_forward() -> None:
    model = tiny_model("mistral_sw")
    assert HFEngine(model, device="cpu")._lean_decoder() is None
