"""The C2C fuser: projects a sharer's KV cache into a receiver's and gates it in per layer.

For every receiver layer ``n`` reading sharer layer ``G(n)``, and separately for keys and
values (one branch each)::

    xs = flatten_heads(sharer_kv[G(n)])          # [B, N, Hs*Ds]   (aligned to receiver tokens)
    xt = flatten_heads(receiver_kv[n])           # [B, N, Ht*Dt]
    z  = blocks(Linear_in(concat(xs, xt)))       # [B, N, hidden]  residual MLP blocks
    P  = Linear_out(z)  -> [B, Ht, N, Dt]         # projected KV in the receiver's head layout
    w  = sigmoid(Linear_w(z)) -> [B, Ht, N, 1]   # dynamic weight, per token and per head
    g  = gate(layer, K|V)                        # Gumbel-sigmoid while training, 0/1 at inference
    out = receiver_kv[n] + g * w * P * mask      # mask: 1 on shared-context tokens only

A closed gate (hard 0) returns the receiver tensor itself: the cache stays bit-identical.
All branches run together as batched matrix products (weights stacked per branch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ._spec import ModelSpec, layer_mapping

__all__ = ["Fuser", "FuserConfig", "GateMode", "estimate_parameters"]

FORMAT_VERSION = 1

GateMode = str  # "auto" (soft while training, hard at eval), "hard", "soft", "open", "closed"
_GATE_MODES = ("auto", "hard", "soft", "open", "closed")


@dataclass(slots=True)
class FuserConfig:
    """Everything needed to rebuild a fuser; stored as JSON next to its safetensors weights."""

    sharer: ModelSpec  # the pair the fuser was built for
    receiver: ModelSpec
    hidden_dim: int = 256  # width of the residual MLP
    num_blocks: int = 2  # residual MLP blocks (RMSNorm -> Linear -> GELU -> Linear, + skip)
    intermediate_mult: float = 2.0  # MLP inner width = hidden_dim * intermediate_mult
    dropout: float = 0.1
    mapping: str | list[int] = "last_aligned"  # strategy name or explicit sharer layer per layer
    gate_init: float = 0.0  # initial gate logit (sigmoid(0) = 0.5)
    tau_start: float = 1.0  # Gumbel-sigmoid temperature at step 0 ...
    tau_end: float = 0.001  # ... annealed geometrically to this value at anneal_steps
    anneal_steps: int = 1000
    zero_init: bool = True  # output projection starts at zero: training starts at the receiver
    layers: list[int] = field(default_factory=list)  # resolved mapping (filled in __post_init__)

    def __post_init__(self) -> None:
        if self.hidden_dim < 1 or self.num_blocks < 0:
            raise ConfigError(
                f"fuser hidden_dim must be >= 1 and num_blocks >= 0 "
                f"(got hidden_dim={self.hidden_dim}, num_blocks={self.num_blocks})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"fuser dropout must be in [0, 1) (got {self.dropout})")
        if self.tau_start <= 0 or self.tau_end <= 0:
            raise ConfigError("fuser tau_start and tau_end must be > 0")
        resolved = layer_mapping(self.mapping, self.receiver.num_layers, self.sharer.num_layers)
        if self.layers and list(self.layers) != resolved:
            raise ConfigError(
                f"fuser config: stored layers {self.layers} disagree with mapping "
                f"{self.mapping!r} -> {resolved}"
            )
        self.layers = resolved

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["sharer"] = self.sharer.to_dict()
        data["receiver"] = self.receiver.to_dict()
        data["format_version"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FuserConfig:
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ConfigError(
                f"fuser config format_version {version} is not supported (expected "
                f"{FORMAT_VERSION})"
            )
        known = {f for f in cls.__dataclass_fields__}  # type: ignore[attr-defined]
        unknown = sorted(set(data) - known - {"format_version"})
        if unknown:
            raise ConfigError(f"fuser config: unknown keys {unknown}")
        try:
            kwargs = {k: v for k, v in data.items() if k in known}
            kwargs["sharer"] = ModelSpec.from_dict(data["sharer"])
            kwargs["receiver"] = ModelSpec.from_dict(data["receiver"])
        except KeyError as exc:
            raise ConfigError(f"fuser config: missing key {exc}") from exc
        return cls(**kwargs)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _uniform(shape: tuple[int, ...], fan_in: int) -> nn.Parameter:
    # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class Fuser(nn.Module):
    """One K branch and one V branch per receiver layer, each with its own gate.

    The ``G = 2 * receiver_layers`` branches share shapes, so their weights are stored stacked
    (group ``g = 2 * layer + (0 for K, 1 for V)``) and run as batched matrix products: one set
    of ~20 tensor ops fuses every layer, instead of ~12 ops per branch (the per-branch loop
    cost more than the models' own forward passes on CPU for small pairs).

    Per branch: ``z = Linear_in(concat(xs, xt))``, then ``num_blocks`` residual blocks
    ``z + W2(GELU(W1(RMSNorm(z))))``, ``RMSNorm``, then ``P = Linear_out(z)`` and
    ``w = sigmoid(Linear_w(z))``; output ``xt + gate * w * P * mask``.

    Invariants: ``config.layers[n]`` is the sharer layer read by receiver layer ``n``; with
    a closed gate, :meth:`fuse` returns the receiver tensor itself for that branch (bit-
    identical). The trainer sets the temperature ``tau`` with :meth:`set_step`.
    """

    def __init__(self, config: FuserConfig):
        super().__init__()
        self.config = config
        s, r = config.sharer, config.receiver
        g = 2 * len(config.layers)
        h = config.hidden_dim
        inner = max(1, round(h * config.intermediate_mult))
        a = s.kv_dim + r.kv_dim
        o, heads, nb = r.kv_dim, r.num_kv_heads, config.num_blocks
        self.w_in = _uniform((g, a, h), a)  # [G, A, h]
        self.b_in = _uniform((g, 1, h), a)
        self.block_norm = nn.Parameter(torch.ones(nb, g, 1, h))
        self.block_up = _uniform((nb, g, h, inner), h)  # [blocks, G, h, i]
        self.block_down = _uniform((nb, g, inner, h), inner)
        self.norm_out = nn.Parameter(torch.ones(g, 1, h))
        self.w_out = _uniform((g, h, o), h)  # [G, h, Ht*Dt]
        self.b_out = _uniform((g, 1, o), h)
        self.w_weight = _uniform((g, h, heads), h)  # [G, h, Ht]
        self.b_weight = _uniform((g, 1, heads), h)
        self.gate_logit = nn.Parameter(torch.full((g,), float(config.gate_init)))
        if config.zero_init:
            with torch.no_grad():
                self.w_out.zero_()
                self.b_out.zero_()
        self.gate_mode: GateMode = "auto"
        self.tau = float(config.tau_start)

    # -- bookkeeping -------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_step(self, step: int) -> float:
        """Anneal the Gumbel-sigmoid temperature geometrically; returns the new tau."""
        c = self.config
        frac = min(max(step, 0) / max(c.anneal_steps, 1), 1.0)
        self.tau = c.tau_start * (c.tau_end / c.tau_start) ** frac
        return self.tau

    def set_gate_mode(self, mode: GateMode) -> None:
        if mode not in _GATE_MODES:
            raise ValueError(f"gate mode must be one of {_GATE_MODES}, got {mode!r}")
        self.gate_mode = mode

    @staticmethod
    def group(layer: int, kind: str) -> int:
        """Index of the branch of receiver ``layer`` for ``kind`` ("key" or "value")."""
        return 2 * layer + (0 if kind == "key" else 1)

    def gates(self) -> dict[str, list[bool]]:
        """Hard gate state per receiver layer (what inference uses)."""
        on = (self.gate_logit.detach() > 0).tolist()
        return {"key": on[0::2], "value": on[1::2]}

    def _mode(self) -> str:
        if self.gate_mode == "auto":
            return "soft" if self.training else "hard"
        return self.gate_mode

    def _open_groups(self, mode: str) -> list[int]:
        if mode == "closed":
            return []
        if mode == "hard":
            return [i for i, on in enumerate((self.gate_logit.detach() > 0).tolist()) if on]
        return list(range(self.gate_logit.shape[0]))

    # -- fusion ------------------------------------------------------------------------
    def fuse(
        self,
        sharer_layers: list[tuple[torch.Tensor, torch.Tensor]],
        receiver_layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fuse every receiver layer.

        sharer_layers: per sharer layer ([B, Hs, N, Ds], ...) already aligned to the
        receiver's N tokens; receiver_layers: per receiver layer ([B, Ht, N, Dt], ...);
        mask: [B, N], 1.0 where a token is fused (None = all tokens).
        """
        c = self.config
        if len(receiver_layers) != len(c.layers):
            raise ConfigError(
                f"fuser expects {len(c.layers)} receiver layers, got {len(receiver_layers)}"
            )
        if len(sharer_layers) != c.sharer.num_layers:
            raise ConfigError(
                f"fuser expects {c.sharer.num_layers} sharer layers, got {len(sharer_layers)}"
            )
        mode = self._mode()
        groups = self._open_groups(mode)
        if not groups:
            return list(receiver_layers)
        xt0 = receiver_layers[0][0]
        b, ht, n, dt = xt0.shape
        dtype, device = xt0.dtype, xt0.device
        idx = torch.tensor(groups, device=device)
        # [S, 2, B, Hs, N, Ds] -> receiver-layer order [L, 2, ...] -> open groups [G', ...]
        src = torch.tensor(c.layers, device=device)
        shar = torch.stack([torch.stack(kv) for kv in sharer_layers]).to(dtype)
        shar = shar.index_select(0, src).flatten(0, 1).index_select(0, idx)  # [G',B,Hs,N,Ds]
        recv = torch.stack([torch.stack(kv) for kv in receiver_layers]).flatten(0, 1)
        recv = recv.index_select(0, idx)  # [G', B, Ht, N, Dt]
        g = len(groups)
        xs = shar.permute(0, 1, 3, 2, 4).reshape(g, b * n, -1)  # [G', B*N, Hs*Ds]
        xt = recv.permute(0, 1, 3, 2, 4).reshape(g, b * n, -1)  # [G', B*N, Ht*Dt]
        p = self._select(idx)
        z = torch.baddbmm(p["b_in"], torch.cat([xs, xt], dim=-1), p["w_in"])  # [G', BN, h]
        drop = c.dropout if self.training else 0.0
        for k in range(c.num_blocks):
            y = _rms(z, p["block_norm"][k])
            y = torch.bmm(nn.functional.gelu(torch.bmm(y, p["block_up"][k])), p["block_down"][k])
            z = z + nn.functional.dropout(y, drop, self.training)
        z = _rms(z, p["norm_out"])
        proj = torch.baddbmm(p["b_out"], z, p["w_out"]).view(g, b, n, ht, dt)
        weight = torch.sigmoid(torch.baddbmm(p["b_weight"], z, p["w_weight"])).view(g, b, n, ht, 1)
        delta = (weight * proj).permute(0, 1, 3, 2, 4)  # [G', B, Ht, N, Dt]
        if mask is not None:
            delta = delta * mask.to(dtype)[None, :, None, :, None]
        if mode == "soft":
            # binary-concrete relaxation: logistic noise (difference of two Gumbels), one
            # sample per (branch, batch, head, token), as in the paper
            u = torch.rand(g, b, ht, n, 1, device=device, dtype=dtype).clamp_(1e-6, 1 - 1e-6)
            noise = torch.log(u) - torch.log1p(-u)
            logit = self.gate_logit.index_select(0, idx).to(dtype)[:, None, None, None, None]
            delta = delta * torch.sigmoid((logit + noise) / self.tau)
        fused = (recv + delta).unbind(0)
        out = [list(kv) for kv in receiver_layers]
        for j, grp in enumerate(groups):
            out[grp // 2][grp % 2] = fused[j]
        return [(k, v) for k, v in out]

    def _select(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        full = idx.numel() == self.gate_logit.shape[0]
        names = ("w_in", "b_in", "norm_out", "w_out", "b_out", "w_weight", "b_weight")
        sel = {
            k: getattr(self, k) if full else getattr(self, k).index_select(0, idx) for k in names
        }
        for k in ("block_norm", "block_up", "block_down"):
            t = getattr(self, k)
            sel[k] = t if full else t.index_select(1, idx)
        return sel

    def check_models(self, sharer: ModelSpec, receiver: ModelSpec) -> None:
        """Raise a clear error unless ``sharer``/``receiver`` are the pair this fuser fits."""
        from ..errors import NamespaceMismatchError

        c = self.config
        for role, want, got in (("sharer", c.sharer, sharer), ("receiver", c.receiver, receiver)):
            if not want.same_layout(got):
                raise ConfigError(
                    f"fuser was built for {role} {want.describe()}, but the {role} given is "
                    f"{got.describe()}"
                )
        for role, want, got in (("sharer", c.sharer, sharer), ("receiver", c.receiver, receiver)):
            if want.fingerprint and got.fingerprint and want.fingerprint != got.fingerprint:
                raise NamespaceMismatchError(
                    f"fuser was trained for another {role}: fingerprint {want.fingerprint} "
                    f"expected, the {role} given has {got.fingerprint} (same shapes, different "
                    "weights or tokenizer); train a fuser for this pair"
                )


def estimate_parameters(config: FuserConfig) -> int:
    """Parameter count of a fuser built from ``config``, without allocating it.

    Per branch (K or V) of one receiver layer, with ``h = hidden_dim``, ``i = inner width``,
    ``a = sharer kv_dim + receiver kv_dim``, ``o = receiver kv_dim``, ``H = receiver kv heads``:
    ``(a*h + h) + blocks*(h + 2*h*i) + h + (h*o + o) + (h*H + H) + 1``.
    """
    s, r = config.sharer, config.receiver
    h = config.hidden_dim
    inner = max(1, round(h * config.intermediate_mult))
    a, o, heads = s.kv_dim + r.kv_dim, r.kv_dim, r.num_kv_heads
    per_branch = (a * h + h) + config.num_blocks * (h + 2 * h * inner) + h + (h * o + o)
    per_branch += h * heads + heads + 1
    return 2 * len(config.layers) * per_branch
