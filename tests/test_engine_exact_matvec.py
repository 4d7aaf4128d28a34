"""The exact matvec kernel (engine/_exact_matvec.py): F.linear's bits for one float32 row, at
every weight alignment, and the lean step's guard that keeps F.linear where they differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from semcomm.engine import _cache_adapter as ca
from semcomm.engine._exact_matvec import ExactMatVec
from semcomm.engine._lean_decode import LeanDecoder

from ._engine_models import prompt_ids, tiny_model


@pytest.fixture
def mv() -> ExactMatVec:
    kernel = ExactMatVec.shared()
    if kernel is None:
        pytest.skip("no exact matvec here (needs x86-64 with AVX-512 and a C compiler)")
    return kernel


def weight_at(rows: int, cols: int, offset: int, seed: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 weight starting ``offset`` floats past a 64-byte boundary
    (safetensors' memory-mapped weights start at such offsets)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(rows * cols + 16, generator=g)
    return buf[offset : offset + rows * cols].view(rows, cols)


# (rows, cols): the real models' shapes (SmolLM2 576/192/1536, Qwen2.5-0.5B 896/128/4864) and
# short rows whose chunks end before a whole 16-column step
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (896, 896), (128, 896),
          (4864, 896), (896, 4864), (4, 8), (12, 20), (200, 100)]


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4, 6, 8, 10, 13])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_products_are_f_linears_bits(mv: ExactMatVec, one_thread: None, rows: int, cols: int,
                                     offset: int) -> None:
    w = weight_at(rows, cols, offset, seed=rows * 31 + cols + offset)
    g = torch.Generator().manual_seed(offset)
    bias = torch.randn(rows, generator=g)
    assert mv.supports(w)
    with torch.inference_mode():
        for scale in (1.0, 1e3, 1e-3):
            x = torch.randn((1, 1, cols), generator=g) * scale
            assert torch.equal(mv.linear(x, w), F.linear(x, w))
            assert torch.equal(mv.linear(x, w, bias), F.linear(x, w, bias))
    assert mv.matches(w, bias)


@pytest.mark.parametrize("weight", [
    torch.zeros(6, 64),  # rows not in whole groups of 4 (a tail group rounds otherwise)
    torch.zeros(8, 66),  # columns not a multiple of 4
    torch.zeros(8, 4),  # too short
    torch.zeros(64, 8).t(),  # not contiguous
    torch.zeros(8, 64, dtype=torch.bfloat16),
], ids=["rows", "cols", "short", "strided", "bf16"])
def test_unsupported_weights_are_refused(mv: ExactMatVec, weight: torch.Tensor) -> None:
    assert not mv.supports(weight)
    assert not mv.matches(weight)


def lean_and_reference(model: torch.nn.Module) -> tuple[LeanDecoder, ca.ModelRunner]:
    runner = ca.ModelRunner(model)
    lean = LeanDecoder.build(model, runner.base_model())
    assert lean is not None
    return lean, runner


def steps_equal(lean: LeanDecoder, runner: ca.ModelRunner, model: torch.nn.Module) -> bool:
    layout = ca.probe_layout(model, torch.device("cpu"))
    ids = torch.tensor([prompt_ids(30)])
    with torch.inference_mode():
        a = ca.buffer_cache(layout, 32, torch.device("cpu"))
        runner.forward(ids[:, :20], a)
        b = ca.copy_cache(a)
        return all(torch.equal(runner.hidden(ids[:, i : i + 1], a),
                               lean.hidden(ids[:, i : i + 1], b)) for i in range(20, 30))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_lean_steps_run_through_it_at_one_thread(mv: ExactMatVec, one_thread: None,
                                                 family: str) -> None:
    lean, runner = lean_and_reference(tiny_model(family))
    assert lean.fast_matvec() is mv
    assert steps_equal(lean, runner, runner.model)
    torch.set_num_threads(2)  # other thread counts keep F.linear
    assert lean.fast_matvec() is None


class _OffByOneUlp(ExactMatVec):
    """The kernel with its last output nudged by one ulp: what a wrong summation order gives."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        y = super().linear(x, weight, bias)
        y[..., -1] = torch.nextafter(y[..., -1], torch.tensor(float("inf")))
        return y


def test_a_kernel_with_other_bits_is_not_used(mv: ExactMatVec, one_thread: None) -> None:
    model = tiny_model("llama")
    lean, runner = lean_and_reference(model)
    lean.matvec, lean._matvec_ok = _OffByOneUlp(mv.path), None
    assert lean.fast_matvec() is None  # its check against F.linear fails, so F.linear it is
    assert steps_equal(lean, runner, model)


def test_bfloat16_models_keep_f_linear(one_thread: None) -> None:
    lean, _ = lean_and_reference(tiny_model("llama").to(torch.bfloat16))
    assert lean.matvec is None and lean.fast_matvec() is None


def test_a_model_moved_to_bfloat16_is_checked_again(mv: ExactMatVec, one_thread: None) -> None:
    model = tiny_model("qwen2")
    lean, runner = lean_and_reference(model)
    assert lean.fast_matvec() is mv
    model.to(torch.bfloat16)  # the lean decoder's weights are the model's, now bfloat16
    assert lean.fast_matvec() is None
    assert steps_equal(lean, runner, model)


def test_the_full_lm_head_runs_through_it_with_the_heads_bits(mv: ExactMatVec,
                                                              one_thread: None) -> None:
    from semcomm.engine import HFEngine

    from ._engine_models import reference_greedy

    model = tiny_model("llama")
    lean, _ = lean_and_reference(model)
    lm = model.get_output_embeddings()
    h = torch.randn(1, 1, 64)
    with torch.inference_mode():
        assert torch.equal(lean.head_logits(h, lm), lm(h))
    assert list(lean._head_ok.values()) == [True]  # checked once, then through the kernel
    # an engine without the greedy head (every step's logits from the full head) is exact
    ids = prompt_ids(30)
    engine = HFEngine(model, device="cpu", greedy_head=False)
    assert engine.generate(ids, max_new_tokens=12).token_ids == reference_greedy(model, ids, 12)
