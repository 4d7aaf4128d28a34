"""KV codecs: round trips, compression ratios, error bounds and spec parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from semcomm.errors import CodecError
from semcomm.kv import CODECS, Namespace, decode_chunk, encode_chunk, get_codec


def _kv(tokens: int = 64, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, tokens, 64, generator=g)
    k[..., 5] *= 12.0  # a key outlier channel, as real post-RoPE keys have
    v = torch.randn(4, 2, tokens, 64, generator=g)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossless_is_bit_exact(dtype: torch.dtype) -> None:
    k, v = _kv(dtype=dtype)
    codec = get_codec("lossless")
    enc = codec.encode(k, v)
    dk, dv = codec.decode(enc.arrays, num_tokens=64, dtype=str(dtype).split(".")[1])
    assert dk.dtype == dtype and dk.equal(k) and dv.equal(v)
    rep = codec.measure(k, v)
    assert rep.ratio == pytest.approx(1.0) and rep.k_rel_error == rep.v_rel_error == 0.0


@pytest.mark.parametrize(
    ("spec", "min_ratio", "max_err"),
    [
        ("fp8", 3.7, 0.04),
        ("int8", 3.5, 0.006),
        ("int4", 6.0, 0.10),
        ("int2", 10.0, 0.45),
    ],
)
def test_ratio_and_error_bounds_fp32(spec: str, min_ratio: float, max_err: float) -> None:
    k, v = _kv()
    rep = get_codec(spec).measure(k, v)
    assert rep.ratio >= min_ratio
    assert 0.0 < rep.k_rel_error <= max_err and 0.0 < rep.v_rel_error <= max_err


def test_error_grows_as_bits_shrink() -> None:
    k, v = _kv()
    reps = [get_codec(s).measure(k, v) for s in ("int8", "int4", "int2")]
    assert reps[0].k_rel_error < reps[1].k_rel_error < reps[2].k_rel_error
    assert reps[0].v_rel_error < reps[1].v_rel_error < reps[2].v_rel_error
    assert reps[0].ratio < reps[1].ratio < reps[2].ratio


def test_keys_per_channel_beat_per_token_on_outlier_channels() -> None:
    # KIVI's reason for per-channel keys: an outlier channel only widens its own range.
    k, v = _kv()
    rep = get_codec("int4").measure(k, v)
    assert rep.k_rel_error < 0.1


@pytest.mark.parametrize("spec", ["fp8", "int8:g16", "int4:g32", "int2:g32:r5", "int4:g7:o0.01"])
@pytest.mark.parametrize("tokens", [1, 13, 37, 64])
def test_round_trip_shapes_for_partial_chunks(spec: str, tokens: int) -> None:
    k, v = _kv(tokens)
    v = v[..., :48]  # value head dim may differ from the key head dim
    codec = get_codec(spec)
    enc = codec.encode(k, v)
    dk, dv = codec.decode(enc.arrays, num_tokens=tokens, dtype="float32")
    assert dk.shape == k.shape and dv.shape == v.shape


def test_residual_tokens_and_outliers_are_kept_exactly() -> None:
    k, v = _kv(40)
    codec = get_codec("int2:g16:r8:o0.01")
    dk, dv = codec.decode(codec.encode(k, v).arrays, num_tokens=40, dtype="float32")
    assert dk[:, :, 32:].equal(k[:, :, 32:]) and dv[:, :, 32:].equal(v[:, :, 32:])
    top = k[:, :, :32].abs().reshape(-1).topk(10).indices
    assert dk[:, :, :32].reshape(-1)[top].equal(k[:, :, :32].reshape(-1)[top])
    plain = get_codec("int2:g16").measure(k, v)
    better = codec.measure(k, v)
    assert better.k_rel_error < plain.k_rel_error and better.v_rel_error < plain.v_rel_error


def test_numpy_input_is_accepted() -> None:
    k, v = _kv(20)
    codec = get_codec("int4")
    a = codec.encode(k.numpy(), v.numpy()).arrays
    b = codec.encode(k, v).arrays
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_codec_round_trip_through_the_chunk_format() -> None:
    k, v = _kv(24, torch.bfloat16)
    codec = get_codec("int4:g8:r4")
    enc = codec.encode(k, v)
    ns = Namespace("m", "t", "bfloat16", codec.spec, "public").digest
    data = encode_chunk(namespace=ns, key=b"k" * 32, parent=None, num_tokens=24, start=0,
                        dtype="bfloat16", codec=codec.name, codec_params=codec.params,
                        arrays=enc.arrays, bf16_names=enc.bf16_names)
    chunk = decode_chunk(data, expect_namespace=ns)
    dk, _ = codec.decode(chunk.arrays, num_tokens=24, dtype="bfloat16")
    direct, _ = codec.decode(enc.arrays, num_tokens=24, dtype="bfloat16")
    assert dk.equal(direct) and dk[:, :, 20:].equal(k[:, :, 20:])


def test_specs_are_canonical_and_distinct() -> None:
    assert get_codec("int4").spec == get_codec("INT4:g32").spec == "int4:g32"
    assert get_codec("int4:g32:r16").spec != get_codec("int4:g32").spec
    assert get_codec(None).spec == "lossless"
    assert len({get_codec(s).spec for s in CODECS}) == len(CODECS)
    codec = get_codec("int2:g64")
    assert get_codec(codec) is codec


@pytest.mark.parametrize("spec", ["gzip", "int5", "fp8:r2", "int4:q3", "int4:g0", "int4:o0.9", ""])
def test_bad_specs_raise_codec_error(spec: str) -> None:
    with pytest.raises(CodecError):
        get_codec(spec)
