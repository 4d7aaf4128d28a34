"""The exact one-query attention (engine/_exact_attention.py): SDPA's bits over the engine's
cache buffers at every context length (one block, several, every tail), and the lean step's
guards that keep SDPA where it does not apply or differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from semcomm.engine import _cache_adapter as ca
from semcomm.engine._exact_attention import ExactAttention
from semcomm.engine._lean_decode import LeanDecoder

from ._engine_models import prompt_ids, tiny_model


@pytest.fixture
def att() -> ExactAttention:
    kernel = ExactAttention.shared()
    if kernel is None:
        pytest.skip("no exact attention here (needs x86-64 with AVX-512, a C++ compiler and "
                    "torch's headers)")
    return kernel


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The call the lean step and transformers make for one query."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scale,
                                          is_causal=False, enable_gqa=q.shape[1] != k.shape[1])


# (query heads, KV heads, head dim): SmolLM2 9/3/64, Qwen2.5-0.5B 14/2/64, the tiny test
# models 4/2/16, plain multi-head attention, a wide head
HEADS = [(9, 3, 64), (14, 2, 64), (4, 2, 16), (4, 4, 64), (2, 1, 128)]
# one block of 512 keys and its tails of 1-3 keys and of under 16 scores, several blocks
LENGTHS = [1, 2, 3, 5, 8, 12, 15, 17, 62, 64, 255, 511, 512, 513, 514, 515, 1024, 1027, 2047,
           2048, 2049, 2100]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEADS)
def test_attention_is_sdpas_bits(att: ExactAttention, one_thread: None, heads: int,
                                 kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(heads * 7 + dim)
    # views of [1, kv_heads, capacity, dim] buffers, as the engine's cache layers hand them out
    bk = torch.randn((1, kv_heads, 2200, dim), generator=g) * 1.5
    bv = torch.randn((1, kv_heads, 2200, dim), generator=g)
    scale = dim ** -0.5
    with torch.inference_mode():
        for n in LENGTHS:
            for spread in (0.5, 3.0):  # flat and peaked softmax
                q = torch.randn((1, heads, 1, dim), generator=g) * spread
                k, v = bk[:, :, :n], bv[:, :, :n]
                assert att.supports(q, k, v)
                assert torch.equal(att.attend(q, k, v, scale), sdpa(q, k, v, scale)), (n, spread)
    assert att.matches(heads, kv_heads, dim, scale)


def test_what_it_does_not_take_is_refused(att: ExactAttention, one_thread: None) -> None:
    q = torch.randn(1, 4, 1, 16)
    buf = torch.randn(1, 2, 64, 16)
    k = buf[:, :, :40]
    assert att.supports(q, k, k)
    assert not att.supports(q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert not att.supports(torch.randn(1, 4, 2, 16), k, k)  # two queries
    off = torch.randn(2 * 64 * 16 + 4)[4:].view(1, 2, 64, 16)[:, :, :40]  # 16 bytes off
    assert not att.supports(q, off, off)
    assert not att.supports(q, k.transpose(2, 3), k.transpose(2, 3))  # rows not contiguous
    assert not att.supports(torch.randn(1, 3, 1, 16), k, k)  # heads not a multiple
    torch.set_num_threads(2)  # PyTorch's buffers sit elsewhere with more threads
    assert not att.supports(q, k, k)


def long_steps_equal(model: torch.nn.Module, lean: LeanDecoder, prefix: int) -> bool:
    """Lean steps after a ``prefix``-token prompt against the model's forward, bit for bit."""
    runner = ca.ModelRunner(model)
    layout = ca.probe_layout(model, torch.device("cpu"))
    ids = torch.tensor([prompt_ids(prefix + 6)])
    with torch.inference_mode():
        a = ca.buffer_cache(layout, prefix + 8, torch.device("cpu"))
        runner.forward(ids[:, :prefix], a)
        b = ca.copy_cache(a)
        return all(torch.equal(runner.hidden(ids[:, i : i + 1], a),
                               lean.hidden(ids[:, i : i + 1], b))
                   for i in range(prefix, prefix + 6))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lean_steps_attend_through_it_past_a_block(att: ExactAttention, one_thread: None,
                                                   family: str) -> None:
    model = tiny_model(family)
    lean = LeanDecoder.build(model, ca.ModelRunner(model).base_model())
    assert lean is not None and lean.fast_attention() is att
    assert long_steps_equal(model, lean, 515)  # the steps cross 2 blocks, with tails
    assert att.matches(4, 2, 16, lean.layers[0].scaling)


class _OffByOneUlp(ExactAttention):
    """The kernel with one output nudged by one ulp: what a wrong order gives."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        out = super().attend(q, k, v, scale)
        out[0, 0, 0, 0] = torch.nextafter(out[0, 0, 0, 0], torch.tensor(float("inf")))
        return out


def test_an_attention_with_other_bits_is_not_used(att: ExactAttention, one_thread: None) -> None:
    model = tiny_model("llama")
    lean = LeanDecoder.build(model, ca.ModelRunner(model).base_model())
    assert lean is not None
    broken = _OffByOneUlp(att.path)
    lean.attention = broken
    assert not broken.matches(4, 2, 16, lean.layers[0].scaling)  # its check fails: SDPA it is
    assert long_steps_equal(model, lean, 40)
