"""KV codecs: how one chunk's keys and values become byte-ready arrays, and back.

A codec turns the keys and values of one chunk, stacked over layers as ``[L, H, T, D]``
(layers, KV heads, tokens, head dim; keys are post-RoPE as transformers caches them), into a
dict of numpy arrays that :func:`semcomm.kv.encode_chunk` writes, and decodes such a dict back
into torch tensors of the model's dtype. Codecs are values chosen from :data:`CODECS` by a spec
string (``"lossless"``, ``"fp8"``, ``"int8"``, ``"int4:g32"``, ``"int2:g32:r16:o0.01"``); the
canonical spec (:attr:`KVCodec.spec`) goes into the KV namespace, so chunks written by two
codecs, or one codec with two parameter sets, never mix.

Integer codecs follow KIVI (Liu et al., 2024): keys are quantized *per channel* (each channel's
min/max over a group of ``g`` consecutive tokens), values *per token* (each token's min/max over
a group of ``g`` channels), asymmetric (scale and minimum, both stored as float16 and rounded
before use so the stored parameters are exactly the ones quantized against). Options:

Value groups use the largest divisor of the head dim not above ``g`` (so a head dim of 40 gets
groups of 20 channels rather than a padded group of 32).

* ``r<N>`` keeps the last ``N`` tokens of every chunk in the native dtype (KIVI's full-precision
  residual; in a chunked store "most recent" means the end of each chunk).
* ``o<F>`` keeps the fraction ``F`` of entries with the largest magnitude (per K and per V) in
  the native dtype as a sparse list (dense-and-sparse, as in KVQuant/SqueezeLLM); they are set
  to zero before the min/max is taken so they do not widen the quantization range.

``fp8`` stores float8 e4m3 with a float32 scale per channel for keys and per token for values.
``lossless`` stores the native dtype bit for bit (bfloat16 as its raw 16 bits).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CodecError

__all__ = [
    "CODECS",
    "CodecReport",
    "EncodedKV",
    "Fp8Codec",
    "IntCodec",
    "KVCodec",
    "LosslessCodec",
    "get_codec",
    "relative_error",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


@dataclass(frozen=True, slots=True)
class EncodedKV:
    """What a codec produces for one chunk: arrays for the chunk format."""

    arrays: dict[str, np.ndarray]  # name -> little-endian numpy array
    bf16_names: frozenset[str]  # names whose uint16 arrays are bfloat16 bits

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass(frozen=True, slots=True)
class CodecReport:
    """Measured size and error of a codec on given keys and values."""

    spec: str  # canonical codec spec
    raw_bytes: int  # keys + values in the native dtype
    encoded_bytes: int  # sum of the encoded arrays
    ratio: float  # raw_bytes / encoded_bytes
    k_rel_error: float  # ||K - K'||_F / ||K||_F
    v_rel_error: float  # ||V - V'||_F / ||V||_F


def _dtype_name(t: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == t:
            return name
    raise CodecError(f"unsupported KV dtype {t}; supported: {', '.join(_DTYPES)}")


def _as_tensor(x: Any) -> torch.Tensor:
    """Accept a torch tensor or numpy array ``[L, H, T, D]`` and return a CPU tensor."""
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x if x.flags.writeable else x.copy())
    elif isinstance(x, torch.Tensor):
        t = x.detach()
    else:
        raise TypeError(f"expected a torch tensor or numpy array, got {type(x).__name__}")
    if t.dim() != 4:
        raise ValueError(f"KV tensors must be [layers, heads, tokens, head_dim], got {tuple(t.shape)}")
    return t.cpu()


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Tensor -> numpy array, bfloat16 as uint16 bits. Returns (array, is_bf16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("<u2"), True
    return t.numpy(), False


def _from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    """numpy array (maybe read-only; bf16 as uint16 bits) -> a new torch tensor of ``dtype``."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.array(a, dtype="<u2").view("<i2")).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, dtype=np.dtype(_np_name(dtype))))


def _np_name(dtype: str) -> str:
    return {"float32": "<f4", "float16": "<f2"}[dtype]


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y||_F / ||x||_F`` in float64 (0.0 when ``x`` is all zeros and equal to ``y``)."""
    xd, yd = x.double(), y.double()
    denom = float(torch.linalg.vector_norm(xd))
    num = float(torch.linalg.vector_norm(xd - yd))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


class KVCodec(ABC):
    """Encodes one chunk's ``[L, H, T, D]`` keys and values; subclasses register in CODECS."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = False

    @property
    @abstractmethod
    def params(self) -> dict[str, Any]:
        """Parameters as stored in chunk headers (JSON-safe)."""

    @property
    def spec(self) -> str:
        """Canonical spec string; equal specs mean interchangeable bytes."""
        return self.name

    @abstractmethod
    def encode(self, keys: Any, values: Any) -> EncodedKV:
        """Encode keys/values (torch or numpy, ``[L, H, T, D]``)."""

    @abstractmethod
    def decode(
        self, arrays: Mapping[str, np.ndarray], *, num_tokens: int, dtype: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode arrays back to CPU tensors ``[L, H, T, D]`` of ``dtype``."""

    def decode_into(
        self,
        arrays: Mapping[str, np.ndarray],
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        start: int,
        num_tokens: int,
    ) -> None:
        """Decode into ``out_k[:, :, start:start+num_tokens]`` (and ``out_v``) on the CPU."""
        k, v = self.decode(arrays, num_tokens=num_tokens, dtype=_dtype_name(out_k.dtype))
        out_k[:, :, start : start + num_tokens].copy_(k)
        out_v[:, :, start : start + num_tokens].copy_(v)

    def measure(self, keys: Any, values: Any) -> CodecReport:
        """Encode and decode once; report the compression ratio and relative K/V errors."""
        k, v = _as_tensor(keys), _as_tensor(values)
        enc = self.encode(k, v)
        dk, dv = self.decode(enc.arrays, num_tokens=k.shape[2], dtype=_dtype_name(k.dtype))
        raw = k.numel() * k.element_size() + v.numel() * v.element_size()
        return CodecReport(
            spec=self.spec,
            raw_bytes=raw,
            encoded_bytes=enc.nbytes,
            ratio=raw / max(1, enc.nbytes),
            k_rel_error=relative_error(k, dk),
            v_rel_error=relative_error(v, dv),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCodec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)


class LosslessCodec(KVCodec):
    """The native dtype, bit for bit: restores are exact."""

    name = "lossless"
    lossless = True

    @property
    def params(self) -> dict[str, Any]:
        return {}

    def encode(self, keys: Any, values: Any) -> EncodedKV:
        k, bk = _to_numpy(_as_tensor(keys))
        v, bv = _to_numpy(_as_tensor(values))
        bf = frozenset(n for n, b in (("k", bk), ("v", bv)) if b)
        return EncodedKV(arrays={"k": k, "v": v}, bf16_names=bf)

    def decode(
        self, arrays: Mapping[str, np.ndarray], *, num_tokens: int, dtype: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _from_numpy(arrays["k"], dtype), _from_numpy(arrays["v"], dtype)

    def decode_into(
        self,
        arrays: Mapping[str, np.ndarray],
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        start: int,
        num_tokens: int,
    ) -> None:
        # One copy from the (read-only) chunk bytes straight into the destination buffer.
        for name, out in (("k", out_k), ("v", out_v)):
            src = arrays[name]
            dst = out[:, :, start : start + num_tokens]
            if out.dtype == torch.bfloat16:
                dst_np = dst.view(torch.int16).numpy()
                np.copyto(dst_np, src.view("<i2"), casting="no")
            else:
                np.copyto(dst.numpy(), src, casting="no")


class Fp8Codec(KVCodec):
    """float8 e4m3: keys scaled per channel (over the chunk's tokens), values per token."""

    name = "fp8"

    @property
    def params(self) -> dict[str, Any]:
        return {"format": "e4m3", "k_scale": "channel", "v_scale": "token"}

    @staticmethod
    def _quant(x: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray]:
        xf = x.float()
        scale = (xf.abs().amax(dim=dim, keepdim=True) / _FP8_MAX).clamp_min(1e-12)
        q = (xf / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return q.numpy(), scale.squeeze(dim).numpy()

    def encode(self, keys: Any, values: Any) -> EncodedKV:
        k, v = _as_tensor(keys), _as_tensor(values)
        kq, ks = self._quant(k, dim=2)  # scale [L, H, D]: one per channel
        vq, vs = self._quant(v, dim=3)  # scale [L, H, T]: one per token
        return EncodedKV(
            arrays={"k.q": kq, "k.scale": ks, "v.q": vq, "v.scale": vs}, bf16_names=frozenset()
        )

    def decode(
        self, arrays: Mapping[str, np.ndarray], *, num_tokens: int, dtype: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def deq(name: str, dim: int) -> torch.Tensor:
            # A 256-entry lookup table is ~4x faster on CPU than torch's fp8 -> fp32 cast.
            q = torch.from_numpy(np.take(_FP8_LUT, arrays[f"{name}.q"]))
            s = torch.from_numpy(np.array(arrays[f"{name}.scale"])).unsqueeze(dim)
            return q.mul_(s).to(_DTYPES[dtype])

        return deq("k", 2), deq("v", 3)


def _pack(q: torch.Tensor, bits: int) -> np.ndarray:
    """Pack a uint8 tensor of ``bits``-bit values into bytes (low bits first)."""
    flat = q.reshape(-1)
    if bits == 8:
        return flat.numpy()
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.view(-1, per)
    out = lanes[:, 0].clone()
    for i in range(1, per):
        out |= lanes[:, i] << (bits * i)
    return out.numpy()


def _unpack_table(bits: int) -> np.ndarray:
    """``[256, 8 // bits]`` table: byte -> its packed values, low bits first."""
    per = 8 // bits
    b = np.arange(256, dtype=np.uint8)[:, None]
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
    return ((b >> shifts) & ((1 << bits) - 1)).astype(np.uint8)


_UNPACK = {2: _unpack_table(2), 4: _unpack_table(4)}


def _unpack(packed: np.ndarray, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: one table gather per byte (faster than shifting lanes)."""
    if bits == 8:
        return torch.from_numpy(np.array(packed[:count], dtype=np.uint8))
    vals = np.take(_UNPACK[bits], packed, axis=0).reshape(-1)[:count]
    return torch.from_numpy(vals)


def _pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Pad ``dim`` to a multiple by repeating the last slice (does not widen min/max)."""
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x
    last = x.narrow(dim, n - 1, 1)
    reps = [1] * x.dim()
    reps[dim] = pad
    return torch.cat([x, last.repeat(*reps)], dim=dim)


def _value_group(group_size: int, dim: int) -> int:
    """Channels per value group: the largest divisor of ``dim`` not above ``group_size``
    (head dim 64 or 128 -> 32; head dim 40 -> 20), so no group is padded."""
    return max(d for d in range(1, min(group_size, dim) + 1) if dim % d == 0)


def _quant_groups(
    x: torch.Tensor, group_dim: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization reducing over ``group_dim``; returns (q, scale, min)."""
    qmax = (1 << bits) - 1
    mn = x.amin(dim=group_dim, keepdim=True)
    mx = x.amax(dim=group_dim, keepdim=True)
    # Round the parameters to their stored float16 first, so decoding uses exactly these.
    scale = ((mx - mn) / qmax).half().float()
    mn = mn.half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - mn) / scale).clamp_(0, qmax).to(torch.uint8)
    return q, scale.squeeze(group_dim), mn.squeeze(group_dim)


class IntCodec(KVCodec):
    """KIVI-style integer quantization (keys per channel, values per token), see module doc."""

    name = "int"  # concrete names: int8, int4, int2
    bits: int

    def __init__(self, bits: int, group_size: int = 32, residual: int = 0, outliers: float = 0.0):
        if bits not in (2, 4, 8):
            raise CodecError(f"integer codecs support 2, 4 or 8 bits, not {bits}")
        if group_size < 1:
            raise CodecError(f"group size must be >= 1, got {group_size}")
        if residual < 0:
            raise CodecError(f"residual tokens must be >= 0, got {residual}")
        if not 0.0 <= outliers < 0.5:
            raise CodecError(f"outlier fraction must be in [0, 0.5), got {outliers}")
        self.bits = bits
        self.group_size = group_size
        self.residual = residual
        self.outliers = outliers

    @property
    def params(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "residual": self.residual,
            "outliers": self.outliers,
            "k_axis": "channel",
            "v_axis": "token",
        }

    @property
    def spec(self) -> str:
        s = f"int{self.bits}:g{self.group_size}"
        if self.residual:
            s += f":r{self.residual}"
        if self.outliers:
            s += f":o{self.outliers:g}"
        return s

    def _split_outliers(
        self, x: torch.Tensor, prefix: str, arrays: dict[str, np.ndarray], bf: set[str]
    ) -> torch.Tensor:
        """Move the largest-magnitude entries of ``x`` to a sparse list; return x without them."""
        n = math.ceil(self.outliers * x.numel()) if self.outliers else 0
        if n == 0:
            return x.float()
        flat = x.reshape(-1)
        idx = torch.topk(flat.float().abs(), n, sorted=False).indices.sort().values
        vals, isbf = _to_numpy(flat[idx])
        arrays[f"{prefix}.oi"] = idx.to(torch.int32 if flat.numel() < 2**31 else torch.int64).numpy()
        arrays[f"{prefix}.ov"] = vals
        if isbf:
            bf.add(f"{prefix}.ov")
        out = flat.float().clone()
        out[idx] = 0.0
        return out.view(x.shape)

    def encode(self, keys: Any, values: Any) -> EncodedKV:
        k, v = _as_tensor(keys), _as_tensor(values)
        L, H, T, Dk = k.shape
        Dv = v.shape[3]
        r = min(self.residual, T)
        tq = T - r
        arrays: dict[str, np.ndarray] = {"shape": np.array([L, H, tq, Dk, Dv], dtype="<i8")}
        bf: set[str] = set()
        if r:
            for name, x in (("k", k), ("v", v)):
                arr, isbf = _to_numpy(x[:, :, tq:])
                arrays[f"{name}.res"] = arr
                if isbf:
                    bf.add(f"{name}.res")
        if tq:
            g = self.group_size
            # keys: per channel, groups of g tokens -> [L, H, T/g, g, D], reduce over the g tokens
            kq_in = self._split_outliers(k[:, :, :tq], "k", arrays, bf)
            kp = _pad_dim(kq_in, 2, g)
            kq, ks, km = _quant_groups(kp.view(L, H, kp.shape[2] // g, g, Dk), 3, self.bits)
            # values: per token, groups of gv channels -> [L, H, T, D/gv, gv], reduce over channels
            gv = _value_group(g, Dv)
            vq_in = self._split_outliers(v[:, :, :tq], "v", arrays, bf)
            vp = _pad_dim(vq_in, 3, gv)
            vq, vs, vm = _quant_groups(vp.view(L, H, tq, vp.shape[3] // gv, gv), 4, self.bits)
            arrays.update(
                {
                    "k.q": _pack(kq, self.bits),
                    "k.scale": ks.half().numpy(),
                    "k.min": km.half().numpy(),
                    "v.q": _pack(vq, self.bits),
                    "v.scale": vs.half().numpy(),
                    "v.min": vm.half().numpy(),
                }
            )
        return EncodedKV(arrays=arrays, bf16_names=frozenset(bf))

    def decode(
        self, arrays: Mapping[str, np.ndarray], *, num_tokens: int, dtype: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            L, H, tq, Dk, Dv = (int(x) for x in arrays["shape"])
        except (KeyError, ValueError) as exc:
            raise CodecError(f"{self.spec}: chunk lacks a valid 'shape' array") from exc
        out_dt = _DTYPES[dtype]
        parts_k: list[torch.Tensor] = []
        parts_v: list[torch.Tensor] = []
        if tq:
            ks = torch.from_numpy(np.array(arrays["k.scale"])).float()  # [L, H, NG, Dk]
            km = torch.from_numpy(np.array(arrays["k.min"])).float()
            ng = ks.shape[2]
            g = self.group_size
            kq = _unpack(arrays["k.q"], self.bits, L * H * ng * g * Dk).view(L, H, ng, g, Dk)
            k = kq.float().mul_(ks.unsqueeze(3)).add_(km.unsqueeze(3)).view(L, H, ng * g, Dk)
            k = k[:, :, :tq]
            vs = torch.from_numpy(np.array(arrays["v.scale"])).float()  # [L, H, tq, NGv]
            vm = torch.from_numpy(np.array(arrays["v.min"])).float()
            ngv = vs.shape[3]
            gv = _value_group(g, Dv)
            vq = _unpack(arrays["v.q"], self.bits, L * H * tq * ngv * gv).view(L, H, tq, ngv, gv)
            v = vq.float().mul_(vs.unsqueeze(4)).add_(vm.unsqueeze(4)).view(L, H, tq, ngv * gv)
            v = v[..., :Dv]
            k, v = k.contiguous(), v.contiguous()
            for name, x in (("k", k), ("v", v)):
                if f"{name}.oi" in arrays:
                    idx = torch.from_numpy(np.array(arrays[f"{name}.oi"])).long()
                    val = _from_numpy(arrays[f"{name}.ov"], dtype).float()
                    x.view(-1)[idx] = val
            parts_k.append(k.to(out_dt))
            parts_v.append(v.to(out_dt))
        if "k.res" in arrays:
            parts_k.append(_from_numpy(arrays["k.res"], dtype))
            parts_v.append(_from_numpy(arrays["v.res"], dtype))
        k_out = torch.cat(parts_k, dim=2) if len(parts_k) > 1 else parts_k[0]
        v_out = torch.cat(parts_v, dim=2) if len(parts_v) > 1 else parts_v[0]
        if k_out.shape[2] != num_tokens:
            raise CodecError(f"{self.spec}: decoded {k_out.shape[2]} tokens, expected {num_tokens}")
        return k_out, v_out


def _make_int(bits: int) -> Any:
    def make(**kw: Any) -> IntCodec:
        return IntCodec(bits, **kw)

    return make


CODECS: dict[str, Any] = {
    "lossless": LosslessCodec,
    "fp8": Fp8Codec,
    "int8": _make_int(8),
    "int4": _make_int(4),
    "int2": _make_int(2),
}
"""Codec registry: name -> factory taking the parsed keyword parameters."""

_OPTION_KEYS = {"g": ("group_size", int), "r": ("residual", int), "o": ("outliers", float)}


def get_codec(spec: str | KVCodec | None = None) -> KVCodec:
    """Parse a codec spec (``"int4:g32:r16:o0.01"``) or pass a codec object through."""
    if spec is None:
        return LosslessCodec()
    if isinstance(spec, KVCodec):
        return spec
    if not isinstance(spec, str):
        raise CodecError(f"codec must be a spec string or a KVCodec, got {type(spec).__name__}")
    name, *opts = spec.strip().lower().split(":")
    factory = CODECS.get(name)
    if factory is None:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(CODECS))}")
    kwargs: dict[str, Any] = {}
    for opt in opts:
        key = _OPTION_KEYS.get(opt[:1])
        if key is None or not name.startswith("int"):
            raise CodecError(f"codec {name!r} does not take option {opt!r} (spec {spec!r})")
        try:
            kwargs[key[0]] = key[1](opt[1:])
        except ValueError:
            raise CodecError(f"bad value in codec option {opt!r} (spec {spec!r})") from None
    try:
        codec: KVCodec = factory(**kwargs)
    except TypeError as exc:
        raise CodecError(f"bad parameters for codec {name!r}: {exc}") from None
    return codec
