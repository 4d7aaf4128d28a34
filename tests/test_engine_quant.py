"""The quantized-code matvec (engine/_quant_matvec.py): GGUF codes that rebuild the loaded
float32 weights bit for bit, products with F.linear's bits at every alignment, a corrupted code
or scale refused, and a real catalog model's greedy tokens equal to ``generate`` with every
layer product running from the codes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from semcomm.engine._quant_matvec import (
    QuantMatVec,
    QuantWeight,
    _cache_dir,
    codes_from_blocks,
    codes_nbytes,
    gguf_codes_nbytes,
    load_codes,
    peel_of,
    read_gguf_tensors,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

# bytes per block and elements per block of the types the catalog's GGUFs use
_LAYOUT = {"Q8_0": (34, 32), "Q5_0": (22, 32), "Q4_1": (20, 32), "Q4_K": (144, 256),
           "Q6_K": (210, 256)}
# where each block keeps its float16 fields (byte offsets)
_F16_AT = {"Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture
def qmv() -> QuantMatVec:
    kernel = QuantMatVec.shared()
    if kernel is None:
        pytest.skip("no quantized-code matvec here (needs x86-64 with AVX-512 and a C compiler)")
    return kernel


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks with random codes and finite float16 fields of both signs, zeros
    (signed) included: every code and every sign case the formulas meet."""
    size, per = _LAYOUT[kind]
    rng = np.random.default_rng(seed)
    n = rows * cols // per
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _F16_AT[kind]:
        v = (rng.standard_normal(n) * 0.02).astype(np.float16)
        v[rng.random(n) < 0.05] = np.float16(0.0)
        v[rng.random(n) < 0.05] = np.float16(-0.0)
        blocks[:, at:at + 2] = v.view(np.uint8).reshape(n, 2)
    return blocks


def codes(kind: str, blocks: np.ndarray, rows: int, cols: int) -> QuantWeight:
    q, a, b, g = codes_from_blocks(kind, blocks, rows, cols)
    return QuantWeight.from_rows(torch.from_numpy(q), torch.from_numpy(a),
                                 None if b is None else torch.from_numpy(b), g, kind)


def gguf_weight(kind: str, blocks: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """What transformers loads: gguf-py's dequantized float32 tensor."""
    w = dequantize(blocks.reshape(rows, -1), getattr(T, kind)).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def at_offset(w: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``w`` starting ``offset`` floats past a 64-byte boundary."""
    n, k = w.shape
    buf = torch.empty(n * k + 32)
    base = (-(buf.data_ptr() // 4)) % 16
    out = buf[base + offset: base + offset + n * k].view(n, k)
    out.copy_(w)
    return out


@pytest.mark.parametrize("kind", sorted(_LAYOUT))
def test_codes_rebuild_gguf_py_dequantized_weights_bit_for_bit(kind: str) -> None:
    rows, cols = 8, 512
    blocks = random_blocks(kind, rows, cols, seed=len(kind))
    w = gguf_weight(kind, blocks, rows, cols)
    qw = codes(kind, blocks, rows, cols)
    assert qw.group == (16 if kind == "Q6_K" else 32)
    assert qw.equals(w)
    rec = qw.reconstruct().view(torch.int32)
    assert torch.equal(rec, w.view(torch.int32))  # signed zeros included
    assert bool((w.view(torch.int32) == int(np.array(-0.0, np.float32).view(np.int32))).any()) \
        or kind in ("Q4_1", "Q4_K")  # the types without an offset meet -0 (a negative scale)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_1"])
def test_codes_of_gguf_py_quantized_weights(kind: str) -> None:
    """Blocks quantized by gguf-py itself from real-valued data, not only random bytes."""
    rows, cols = 16, 896
    x = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = quantize(x, getattr(T, kind))
    w = gguf_weight(kind, blocks, rows, cols)
    assert codes(kind, blocks, rows, cols).equals(w)


def test_an_unsupported_type_is_named() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        codes_from_blocks("Q2_K", np.zeros((1, 84), np.uint8), 1, 256)


# (rows, cols, type): the catalog models' layer shapes and types (SmolLM2: Q4_1; Qwen2.5-0.5B:
# Q5_0 and Q8_0 at 896 columns, Q4_K and Q6_K for the down projection) and a short row
SHAPES = [(576, 576, "Q4_1"), (192, 576, "Q4_1"), (1536, 576, "Q4_1"), (576, 1536, "Q4_1"),
          (896, 896, "Q5_0"), (128, 896, "Q8_0"), (4864, 896, "Q5_0"), (896, 4864, "Q4_K"),
          (896, 4864, "Q6_K"), (12, 256, "Q6_K")]


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 6])
@pytest.mark.parametrize(("rows", "cols", "kind"), SHAPES)
def test_products_are_f_linears_bits_at_every_alignment(
        qmv: QuantMatVec, one_thread: None, rows: int, cols: int, kind: str,
        offset: int) -> None:
    blocks = random_blocks(kind, rows, cols, seed=rows + cols + offset)
    qw = codes(kind, blocks, rows, cols)
    w = at_offset(gguf_weight(kind, blocks, rows, cols), offset)
    qw.peel = peel_of(w)
    assert qw.peel == 4 - offset % 4
    g = torch.Generator().manual_seed(offset)
    bias = torch.randn(rows, generator=g)
    with torch.inference_mode():
        for scale in (1.0, 1e3, 1e-3):
            x = torch.randn((1, 1, cols), generator=g) * scale
            assert torch.equal(qmv.linear(x, qw).view(torch.int32),
                               F.linear(x, w).view(torch.int32))
            assert torch.equal(qmv.linear(x, qw, bias), F.linear(x, w, bias))
    assert qmv.matches(qw, w, bias)
    # the summation order is the row alignment's: another alignment's order is refused
    qw.peel = 4 - (offset + 1) % 4
    assert not qmv.matches(qw, w, bias)


def test_a_corrupted_code_or_scale_is_refused(qmv: QuantMatVec, one_thread: None) -> None:
    rows, cols = 896, 896
    blocks = random_blocks("Q5_0", rows, cols, seed=7)
    w = at_offset(gguf_weight("Q5_0", blocks, rows, cols), 2)
    good = codes("Q5_0", blocks, rows, cols)
    good.peel = peel_of(w)
    assert good.equals(w) and qmv.matches(good, w)
    for part in ("q", "a"):
        bad = QuantWeight(good.q.clone(), good.a.clone(), None, good.n, good.k, good.group,
                          good.kind, good.peel)
        t = getattr(bad, part)
        flat = t.view(-1)
        i = flat.numel() // 3
        flat[i] = flat[i] + 1 if part == "q" else flat[i] * 1.5 + 1e-3
        assert not bad.equals(w)  # the reconstruction check
        assert not qmv.matches(bad, w)  # and the products' check, each on its own


def test_codes_and_shapes_the_kernel_does_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="quads"):  # rows not in whole groups of 4
        QuantWeight.from_rows(torch.zeros(6, 64, dtype=torch.int8), torch.zeros(6, 2), None,
                              32, "Q8_0")
    short = QuantWeight.from_rows(torch.zeros(8, 16, dtype=torch.int8), torch.zeros(8, 1),
                                  None, 16, "Q6_K")  # shorter than two 16-column steps
    assert not QuantMatVec.supports(short)
    odd = QuantWeight.from_rows(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 8), None,
                                8, "Q8_0")  # blocks of 8: not a type here
    assert not QuantMatVec.supports(odd)
    ok = QuantWeight.from_rows(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 2), None,
                               32, "Q8_0")
    assert QuantMatVec.supports(ok)
    q, a, _ = ok.rows()  # the quads give back the row-major arrays
    assert q.shape == (8, 64) and a.shape == (8, 2)


def test_no_codes_without_a_gguf_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.zeros(8, 64)
    assert load_codes(None, {"blk.0.attn_q.weight": w}) == {}
    monkeypatch.setenv("SEMCOMM_QUANT_MATVEC", "0")
    assert load_codes((Path("/nonexistent.gguf"), "0" * 64),
                      {"blk.0.attn_q.weight": w}) == {}


# ------------------------------------------------------------------ a real catalog model

def _real(name: str) -> tuple[Any, Any]:
    from semcomm.models import is_pulled, model_path

    if not is_pulled(name):
        pytest.skip(f"{name} is not pulled (`semcomm models pull {name}`)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name, pull_missing=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_real_model_decodes_generates_tokens_from_the_codes(qmv: QuantMatVec,
                                                            one_thread: None) -> None:
    """SmolLM2 (Q4_1, its q/k rows permuted by transformers' GGUF loader: matched by
    content): every layer product from the codes, greedy tokens equal ``generate``'s."""
    from semcomm import HFEngine

    model, tok = _real("smollm2-135m-instruct")
    ids = tok("Northwind Rail support notes. Tickets are refundable up to 24 hours before "
              "departure; bicycles travel free outside rush hours. Question: can I bring my "
              "bicycle at noon? Answer:")["input_ids"]
    x = torch.tensor([ids])
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = -1  # no end of turn (an id never produced): 12 tokens, as the engine
    gc.max_new_tokens, gc.do_sample, gc.pad_token_id = 12, False, 0
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x),
                             generation_config=gc)[0, len(ids):].tolist()
    assert len(ref) == 12
    eng = HFEngine(model, tok)
    eng.eos_token_ids = frozenset()
    out = eng.generate(ids, max_new_tokens=12)
    lean = eng._lean_decoder()
    assert lean is not None
    assert lean.quant_in_use() == 7 * model.config.num_hidden_layers  # every product
    assert {q.kind for q in lean.quant.values()} == {"Q4_1", "Q8_0"}  # layers; tied head
    assert out.token_ids == ref
    # the full LM head (sampling, greedy_head=False) from the embedding's Q8_0 codes
    lm = model.get_output_embeddings()
    h = torch.randn((1, 1, model.config.hidden_size), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(lean.head_logits(h, lm).view(torch.int32), lm(h).view(torch.int32))
    assert lean.codes_head(lm) is not None  # what the greedy steps above ran too
    # so no greedy head (its int8 copy of the head) was made
    assert eng._ghead is None and getattr(lm, "_semcomm_greedy_head", None) is None
    # a corrupted code: that weight falls back to the float32 kernel, the rest keep the codes
    name = "blk.3.ffn_up.weight"
    lean.quant[name].q.view(-1)[100] += 1
    lean._matvec_key = ()  # check again, as for another model
    assert lean.quant_in_use() == 7 * model.config.num_hidden_layers - 1
    assert eng.generate(ids, max_new_tokens=12).token_ids == ref
    # a weight changed in place: the codes are read and compared again, that weight's no
    # longer rebuild it (float32 kernel), the others' do (the corrupted one comes back intact)
    with torch.no_grad():
        model.model.layers[5].mlp.down_proj.weight[7, 11] += 0.25
    assert lean.quant_in_use() == 7 * model.config.num_hidden_layers - 1
    assert "blk.5.ffn_down.weight" not in lean.quant and name in lean.quant
    with torch.no_grad():
        ref2 = model.generate(x, attention_mask=torch.ones_like(x),
                              generation_config=gc)[0, len(ids):].tolist()
    assert eng.generate(ids, max_new_tokens=12).token_ids == ref2
    # at two threads the exact kernels (and the head's codes) are off: greedy steps make the
    # greedy head on first need, and give generate's tokens at that thread count
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            ref3 = model.generate(x, attention_mask=torch.ones_like(x),
                                  generation_config=gc)[0, len(ids):].tolist()
        assert eng.generate(ids, max_new_tokens=12).token_ids == ref3
        assert eng._ghead is not None  # tried now (a GreedyHead, or False where its checks fail)
        assert getattr(lm, "_semcomm_greedy_head", None) is not None
    finally:
        torch.set_num_threads(1)


def write_gguf(path: Path) -> dict[str, torch.Tensor]:
    """A small GGUF written by gguf-py (metadata of several kinds, arrays of strings included,
    then quantized and float32 tensors); returns its quantized tensors as transformers would
    load them (gguf-py's dequantized float32), by GGUF name."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "test")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5] * 150)
    w.add_uint32("llama.block_count", 2)
    w.add_float32("x.f", 1.5)
    w.add_bool("x.b", True)
    rng = np.random.default_rng(0)
    loaded = {}
    for name, (rows, cols), kind in (("blk.0.attn_q.weight", (8, 64), "Q8_0"),
                                     ("blk.0.ffn_up.weight", (12, 96), "Q5_0"),
                                     ("blk.0.ffn_gate.weight", (16, 64), "Q4_1"),
                                     ("output_norm.weight", (1, 64), "F32")):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        qt = getattr(T, kind)
        if kind == "F32":
            w.add_tensor(name, x.reshape(-1))
        else:
            blocks = quantize(x, qt)
            w.add_tensor(name, blocks, raw_dtype=qt)
            loaded[name] = gguf_weight(kind, blocks, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return loaded


def test_gguf_tensor_table_is_read_as_gguf_py_reads_it(tmp_path: Path) -> None:
    """The tensor table read directly (names, types, dims, bytes) equals gguf-py's reader on a
    file gguf-py wrote; a truncated file is refused."""
    path = tmp_path / "t.gguf"
    write_gguf(path)
    mine = read_gguf_tensors(path, gguf)
    ref = gguf.GGUFReader(str(path))
    assert sorted(mine) == sorted(t.name for t in ref.tensors)
    for t in ref.tensors:
        m = mine[t.name]
        assert m.kind == t.tensor_type.name
        assert list(m.dims) == [int(d) for d in t.shape]
        assert np.array_equal(m.data, np.asarray(t.data).reshape(-1).view(np.uint8))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="past the end"):
        read_gguf_tensors(cut, gguf)


def test_the_codes_bytes_are_priced_from_the_tensor_table(tmp_path: Path) -> None:
    """What a memory plan prices before load equals what the built codes hold."""
    path = tmp_path / "t.gguf"
    weights = write_gguf(path)
    built = load_codes((path, "cd" * 32), weights)
    assert len(built) == 3
    sizes = gguf_codes_nbytes(path, [*weights, "output_norm.weight", "missing.weight"])
    assert sizes == {n: q.nbytes for n, q in built.items()}  # F32 and absent tensors: none
    for kind in sorted(_LAYOUT):
        qw = codes(kind, random_blocks(kind, 8, 512, seed=1), 8, 512)
        assert codes_nbytes(kind, 8, 512) == qw.nbytes, kind
    assert codes_nbytes("F16", 8, 512) == 0 and codes_nbytes("Q8_0", 6, 512) == 0
    assert gguf_codes_nbytes(tmp_path / "nowhere.gguf", ["blk.0.attn_q.weight"]) == {}


def test_codes_are_built_once_cached_and_checked_again_on_every_load(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    weights = write_gguf(path)
    src = (path, "ab" * 32)
    first = load_codes(src, weights)
    assert sorted(first) == sorted(weights)
    assert {q.kind for q in first.values()} == {"Q8_0", "Q5_0", "Q4_1"}
    files = sorted(_cache_dir(src[1]).glob("*.npz"))
    assert len(files) == 3
    path.unlink()  # later loads read the cache, not the GGUF
    again = load_codes(src, weights)
    assert sorted(again) == sorted(weights)
    assert all(torch.equal(again[n].q, first[n].q) and again[n].kind == first[n].kind
               for n in weights)
    # a weight that is no longer what the codes rebuild is left out (the GGUF is gone, so
    # nothing rebuilds it), the others still load from the cache
    changed = dict(weights)
    changed["blk.0.ffn_up.weight"] = weights["blk.0.ffn_up.weight"].clone()
    changed["blk.0.ffn_up.weight"][3, 5] += 1.0
    assert sorted(load_codes(src, changed)) == ["blk.0.attn_q.weight", "blk.0.ffn_gate.weight"]
