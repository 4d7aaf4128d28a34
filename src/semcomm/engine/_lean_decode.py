"""One decode step of a Llama-family model with the model's own tensor operations and none of
its per-call machinery.

A decode step on the CPU runs a few hundred small operations a token, and transformers wraps each
layer, attention and norm in module calls, keyword-deprecation wrappers, output-capture hooks
and attention-interface lookups: on a 30-layer model that is milliseconds a token, a large
share of a step whose matrix products take 30-50 ms. :class:`LeanDecoder` runs the same
operations, in the same order, with the same arguments (so the same kernels and the same bits),
straight from the weights: RMSNorm, q/k/v projections, rotary embedding, the cache update, one
``scaled_dot_product_attention`` call exactly as transformers' SDPA integration makes it for one
query (no mask, ``enable_gqa`` for grouped KV heads), the output projection and the gated MLP.

It covers the layer classes whose forward it mirrors (Llama, Mistral and Qwen2 without sliding
layers, SDPA attention); :meth:`LeanDecoder.build` returns None for anything else, and the
engine compares a lean step with the model's own forward bit for bit before using it
(``HFEngine._lean_decoder``).

With one thread and float32 weights, the step's matrix-vector products run through
:class:`~semcomm.engine._exact_matvec.ExactMatVec` (MKL's summation order at twice its speed)
once every weight of the model has given ``F.linear``'s bits through it, and its attention
through :class:`~semcomm.engine._exact_attention.ExactAttention` (SDPA's bits, each cached key
and value read once for all the query heads that share it) once it has given SDPA's bits for
the model's head shapes; anywhere else, and where a check fails, they are ``F.linear`` and SDPA
as in the model. For a catalog model whose GGUF is beside its directory, the products whose
weights the GGUF's quantized codes reproduce bit for bit run through
:class:`~semcomm.engine._quant_matvec.QuantMatVec` instead (the same MKL order from int8 codes
and per-block scales, a third of the bytes), each one checked against ``F.linear`` first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ._exact_attention import ExactAttention
from ._exact_matvec import ExactMatVec
from ._quant_matvec import (
    GGUF_LAYER_NAMES,
    QuantMatVec,
    QuantWeight,
    find_gguf,
    gguf_beside,
    gguf_codes_nbytes,
    layer_weight_names,
    load_codes,
    quant_enabled,
)

__all__ = ["LeanDecoder", "codes_nbytes_on", "planned_codes_nbytes"]

logger = logging.getLogger("semcomm.engine")

# layer, attention, MLP and norm classes whose forward the step mirrors, by family prefix
_FAMILIES = ("Llama", "Mistral", "Qwen2")


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights and constants (views of the model's parameters)."""

    index: int
    ln1: torch.Tensor  # [hidden] input RMSNorm weight
    eps1: float
    wq: torch.Tensor  # [heads * head_dim, hidden]
    bq: torch.Tensor | None
    wk: torch.Tensor  # [kv_heads * head_dim, hidden]
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor  # [hidden, heads * head_dim]
    bo: torch.Tensor | None
    ln2: torch.Tensor  # post-attention RMSNorm weight
    eps2: float
    wg: torch.Tensor  # gate [intermediate, hidden]
    wu: torch.Tensor  # up
    wd: torch.Tensor  # down [hidden, intermediate]
    act: Any  # the MLP's activation module (ACT2FN[hidden_act])
    scaling: float
    head_dim: int
    gqa: bool  # grouped KV heads: SDPA with enable_gqa=True


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op."""
    dt = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return w * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _bind(qmv: QuantMatVec, qw: QuantWeight) -> Any:
    """``f(x, weight, bias)`` with ``F.linear``'s bits from the codes (``weight`` unused)."""
    fn = qmv.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        return fn(x, qw, bias)

    return linear


def _is(module: Any, suffix: str) -> bool:
    name = type(module).__name__
    return any(name == f + suffix for f in _FAMILIES)


class LeanDecoder:
    """One-token steps of a supported model on a cache of the engine's buffer layers.

    ``hidden(input_ids, cache)`` (``input_ids`` ``[1, 1]``) appends the token's K/V to every
    layer and returns the final normed hidden state ``[1, 1, hidden]``, what the causal LM's
    head reads.
    """

    def __init__(self, base: Any, layers: Sequence[_Layer], matvec: ExactMatVec | None = None,
                 attention: ExactAttention | None = None):
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm_w = base.norm.weight
        self.norm_eps = float(base.norm.variance_epsilon)
        self.layers = tuple(layers)
        self.matvec = matvec  # the exact matvec kernel, where it loaded
        self.attention = attention  # the exact one-query attention, where it loaded
        # whether every weight gives F.linear's bits through it (checked at one thread, once
        # for the weights' storage and dtype: a model moved to another dtype is checked again)
        self._matvec_ok: bool | None = None
        self._matvec_key: tuple[Any, ...] = ()
        self._head_ok: dict[tuple[Any, ...], bool] = {}  # LM-head weights checked, by storage
        self._all_w = [w for w, _ in self._weights()]
        # the GGUF's codes of the weights they reproduce (by GGUF name), the kernel that runs
        # them, and per layer the 7 products (q, k, v, o, gate, up, down): a quantized-code
        # product where its check passed, else None (the float32 kernel)
        self.quant: dict[str, QuantWeight] = {}
        self.qmatvec: QuantMatVec | None = None
        self._qlins: list[tuple[Any, ...]] | None = None
        self._gguf: tuple[Any, str] | None = None  # (GGUF path, digest) to read the codes from
        self._head: tuple[str, torch.Tensor] | None = None  # the LM head's GGUF name and weight

    def _weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(w, b) for p in self.layers for w, b in
                ((p.wq, p.bq), (p.wk, p.bk), (p.wv, p.bv), (p.wo, p.bo), (p.wg, None),
                 (p.wu, None), (p.wd, None))]

    def fast_matvec(self) -> ExactMatVec | None:
        """The kernel the step's products run through now: the exact matvec at one thread once
        all of the model's float32 weights matched ``F.linear`` through it (checked on the first
        call at one thread), else None (``F.linear``)."""
        mv = self.matvec
        if mv is None or torch.get_num_threads() != 1:
            return None
        first, last = self.layers[0].wq, self.layers[-1].wd
        # the weights' versions too: a weight changed in place is checked again (its codes
        # read and compared with it anew)
        key = (first.data_ptr(), first.dtype, last.data_ptr(), last.dtype,
               sum(w._version for w in self._all_w))
        if key != self._matvec_key:
            if self._matvec_key:
                self.quant = {}
            self._matvec_key = key
            self._matvec_ok = all(mv.matches(w, b) for w, b in self._weights())
            if not self._matvec_ok:
                logger.info("exact matvec off for this model: its weights are not float32 or "
                            "a weight's products differ from F.linear's")
            self._qlins = self._quant_lins() if self._matvec_ok else None
        return mv if self._matvec_ok else None

    def _quant_lins(self) -> list[tuple[Any, ...]] | None:
        """Per layer, the 7 products through the quantized codes where their check against
        ``F.linear`` passes here (at one thread), else None; None where no weight has codes."""
        qmv = self.qmatvec
        if qmv is None:
            return None
        if not self.quant and self._gguf is not None:
            weights = layer_weight_names(self.layers)
            if self._head is not None:
                weights[self._head[0]] = self._head[1]
            self.quant = load_codes(self._gguf, weights)
        if not self.quant:
            return None
        out: list[tuple[Any, ...]] = []
        used: dict[str, int] = {}
        failed: list[str] = []
        for p in self.layers:
            row: list[Any] = []
            for attr in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
                name = f"blk.{p.index}.{GGUF_LAYER_NAMES[attr]}.weight"
                qw = self.quant.get(name)
                w = getattr(p, attr)
                b = getattr(p, "b" + attr[1], None) if attr in ("wq", "wk", "wv", "wo") else None
                if qw is not None and not qmv.matches(qw, w, b):
                    failed.append(name)
                    qw = None
                if qw is None:
                    row.append(None)
                    continue
                used[qw.kind] = used.get(qw.kind, 0) + 1
                row.append(_bind(qmv, qw))
            out.append(tuple(row))
        n = sum(used.values())
        total = 7 * len(self.layers)
        logger.info("quantized-code matvec on for %d of %d weights (%s, %.0f MB of codes); "
                    "the float32 kernel for the rest%s", n, total,
                    ", ".join(f"{k} {v}" for k, v in sorted(used.items())),
                    sum(q.nbytes for q in self.quant.values()) / 2**20,
                    f" (products differ from F.linear's: {', '.join(failed)})" if failed else "")
        return out if n else None

    def quant_in_use(self) -> int:
        """How many of the step's products run through the quantized codes now."""
        if self.fast_matvec() is None or self._qlins is None:
            return 0
        return sum(f is not None for row in self._qlins for f in row)

    def codes_head(self, lm: Any) -> QuantWeight | None:
        """The GGUF's codes of the LM head ``lm`` where the step's products run through the
        exact kernels and the codes rebuild its weight bit for bit and give ``F.linear``'s
        products (checked once a weight and version), else None. The full head from them reads
        fewer bytes than the greedy head's int8 copy and gives every exact logit."""
        if (self._head is None or self.qmatvec is None or self.fast_matvec() is None
                or not isinstance(lm, torch.nn.Linear)):
            return None
        qw = self.quant.get(self._head[0])
        w, b = lm.weight, lm.bias
        if qw is None or self._head[1].data_ptr() != w.data_ptr():
            return None
        qkey = ("codes", w.data_ptr(), w.dtype, tuple(w.shape), b is None, w._version)
        ok = self._head_ok.get(qkey)
        if ok is None:
            bias = None if b is None else b.detach()
            ok = self._head_ok[qkey] = qw.equals(w.detach()) and self.qmatvec.matches(
                qw, w.detach(), bias)
            logger.info("quantized-code LM head %s", "on" if ok else
                        "off: its codes do not rebuild the weight or its products differ")
        return qw if ok else None

    def head_logits(self, h: torch.Tensor, lm: Any) -> torch.Tensor:
        """``lm(h)`` for the LM head ``lm`` (``[1, 1, vocab]``), the same bits: from the GGUF's
        codes of the head (:meth:`codes_head`), else through the exact matvec when the step's
        products run through it and the head is a linear layer whose weight matched
        ``F.linear`` through it (checked once a weight); else the head itself."""
        mv = self.fast_matvec()
        if mv is None or not isinstance(lm, torch.nn.Linear) or h.dtype != torch.float32:
            return lm(h)  # type: ignore[no-any-return]
        w, b = lm.weight, lm.bias
        qw = self.codes_head(lm)
        if qw is not None and self.qmatvec is not None:
            return self.qmatvec.linear(h, qw, b)
        key = (w.data_ptr(), w.dtype, tuple(w.shape), b is None)
        ok = self._head_ok.get(key)
        if ok is None:
            ok = self._head_ok[key] = mv.matches(w.detach(), None if b is None else b.detach())
        return mv.linear(h, w, b) if ok else lm(h)

    def fast_attention(self) -> ExactAttention | None:
        """The exact attention at one thread for a float32 model, else None (SDPA); each call
        still checks its tensors (:meth:`ExactAttention.supports`) and head shapes
        (:meth:`ExactAttention.matches`, once a shape)."""
        att = self.attention
        if att is None or torch.get_num_threads() != 1:
            return None
        return att if self.layers[0].wq.dtype == torch.float32 else None

    @classmethod
    def build(cls, model: Any, base: Any, matvec: bool = True) -> LeanDecoder | None:
        """A lean decoder for ``model`` (its base model ``base``), or None where its layers
        are not the classes mirrored here or use what the step leaves out. ``matvec=False``
        keeps ``F.linear`` for every product and SDPA for attention."""
        cfg = getattr(model, "config", None)
        if base is None or cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
            return None
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return None
        if getattr(cfg, "sliding_window", None) is not None and (
                getattr(cfg, "use_sliding_window", True)):
            return None
        parts = [getattr(base, a, None) for a in ("embed_tokens", "rotary_emb", "norm", "layers")]
        if any(p is None for p in parts) or not _is(base.norm, "RMSNorm"):
            return None
        out = []
        for i, layer in enumerate(base.layers):
            att: Any = getattr(layer, "self_attn", None)
            mlp: Any = getattr(layer, "mlp", None)
            if not (_is(layer, "DecoderLayer") and _is(att, "Attention") and _is(mlp, "MLP")
                    and _is(layer.input_layernorm, "RMSNorm")
                    and _is(layer.post_attention_layernorm, "RMSNorm")):
                return None
            if getattr(att, "layer_idx", i) != i or getattr(att, "sliding_window", None):
                return None
            head_dim = int(att.head_dim)
            if head_dim > 256 or any(getattr(m, "bias", None) is not None
                                     for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                return None
            out.append(_Layer(
                index=i, ln1=layer.input_layernorm.weight,
                eps1=float(layer.input_layernorm.variance_epsilon),
                wq=att.q_proj.weight, bq=att.q_proj.bias, wk=att.k_proj.weight,
                bk=att.k_proj.bias, wv=att.v_proj.weight, bv=att.v_proj.bias,
                wo=att.o_proj.weight, bo=att.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight,
                eps2=float(layer.post_attention_layernorm.variance_epsilon),
                wg=mlp.gate_proj.weight, wu=mlp.up_proj.weight, wd=mlp.down_proj.weight,
                act=mlp.act_fn, scaling=float(att.scaling), head_dim=head_dim,
                gqa=int(att.num_key_value_groups) > 1,
            ))
        if not out or len(out) != int(getattr(cfg, "num_hidden_layers", len(out))):
            return None
        cpu32 = all(p.wq.dtype == torch.float32 and p.wq.device.type == "cpu" for p in out)
        lean = cls(base, out, ExactMatVec.shared() if matvec and cpu32 else None,
                   ExactAttention.shared() if matvec and cpu32 else None)
        if lean.matvec is not None:
            lean.qmatvec = QuantMatVec.shared()
            # a catalog model with its GGUF: the codes are read on the first step at one thread
            lean._gguf = find_gguf(model) if lean.qmatvec is not None else None
            lm = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            if isinstance(lm, torch.nn.Linear) and lm.bias is None:
                tied = lm.weight.data_ptr() == base.embed_tokens.weight.data_ptr()
                lean._head = ("token_embd.weight" if tied else "output.weight",
                              lm.weight.detach())
        lean.fast_matvec()  # checks the weights now when running at one thread
        return lean

    def hidden(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        x = self.embed(input_ids)  # [1, 1, hidden]
        past = int(cache.get_seq_length())
        pos = (torch.arange(1, device=x.device) + past).unsqueeze(0)
        cos, sin = self.rotary(x, position_ids=pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, 1, head_dim]
        layers = cache.layers
        sdpa = F.scaled_dot_product_attention
        mv = self.fast_matvec()
        lin: Any = mv.linear if mv is not None else F.linear  # the same bits either way
        qlins = self._qlins if mv is not None else None
        plain = (lin,) * 7
        att = self.fast_attention()
        for p in self.layers:
            d = p.head_dim
            lq, lk, lv, lo, lg, lu, ld = (
                plain if qlins is None else (f or lin for f in qlins[p.index]))
            h = _rms(x, p.ln1, p.eps1)
            q = lq(h, p.wq, p.bq).view(1, 1, -1, d).transpose(1, 2)  # [1, H, 1, d]
            k = lk(h, p.wk, p.bk).view(1, 1, -1, d).transpose(1, 2)  # [1, Hkv, 1, d]
            v = lv(h, p.wv, p.bv).view(1, 1, -1, d).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = layers[p.index].update(k, v)
            if att is not None and att.supports(q, k, v) and att.matches(
                    q.shape[1], k.shape[1], d, p.scaling):
                o = att.attend(q, k, v, p.scaling)  # SDPA's bits
            elif p.gqa:
                o = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=p.scaling,
                         is_causal=False, enable_gqa=True)
            else:
                o = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=p.scaling,
                         is_causal=False)
            o = o.reshape(o.shape[0], -1, 1, d).transpose(1, 2).contiguous()
            o = o.reshape(1, 1, -1).contiguous()
            x = x + lo(o, p.wo, p.bo)
            h = _rms(x, p.ln2, p.eps2)
            x = x + ld(p.act(lg(h, p.wg, None)) * lu(h, p.wu, None), p.wd, None)
        return _rms(x, self.norm_w, self.norm_eps)


def _lean_config(config: Any) -> bool:
    """Whether a config is of a model :meth:`LeanDecoder.build` takes (a Llama, Mistral or
    Qwen2 decoder without sliding layers), read before the model is loaded."""
    if isinstance(config, dict):
        config = type("Cfg", (), dict(config))()
    if str(getattr(config, "model_type", "")) not in ("llama", "mistral", "qwen2"):
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return False
    return not (getattr(config, "sliding_window", None) is not None
                and getattr(config, "use_sliding_window", True))


def planned_codes_nbytes(model_dir: str | Path, config: Any, *, dtype: Any = "float32",
                         threads: int | None = None, device: Any = "cpu") -> tuple[int, int]:
    """``(layer codes, LM-head codes)``: the bytes of the GGUF's quantized codes the lean
    decoder of the model in ``model_dir`` (its transformers ``config``) will keep beside its
    float32 weights, from the GGUF's tensor table without building a code (what a memory plan
    prices before load). ``(0, 0)`` where none are built: not float32 on the CPU, not one
    thread (``threads``, default torch's count now), ``SEMCOMM_QUANT_MATVEC=0``, a model the
    lean decoder does not take, no GGUF beside the directory, or no exact kernels here. The
    head's codes are those of ``output.weight`` (``token_embd.weight`` for a tied head); where
    they are counted, greedy steps take the head from them and no greedy head is made."""
    if str(dtype).removeprefix("torch.") != "float32" or torch.device(device).type != "cpu":
        return 0, 0
    if (torch.get_num_threads() if threads is None else threads) != 1 or not quant_enabled():
        return 0, 0
    if not _lean_config(config):
        return 0, 0
    src = gguf_beside(model_dir)
    if src is None or ExactMatVec.shared() is None or QuantMatVec.shared() is None:
        return 0, 0
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    names = [f"blk.{i}.{g}.weight" for i in range(layers) for g in GGUF_LAYER_NAMES.values()]
    head = "token_embd.weight" if getattr(config, "tie_word_embeddings", False) else (
        "output.weight")
    sizes = gguf_codes_nbytes(src[0], [*names, head])
    return sum(v for k, v in sizes.items() if k != head), sizes.get(head, 0)


def codes_nbytes_on(model: Any) -> int:
    """Bytes of the quantized codes the lean decoder of a loaded ``model`` keeps now (layers
    and LM head; 0 without a lean decoder or codes)."""
    lean = getattr(model, "_semcomm_lean_decoder", None)
    if not isinstance(lean, LeanDecoder):
        return 0
    return sum(q.nbytes for q in lean.quant.values())
