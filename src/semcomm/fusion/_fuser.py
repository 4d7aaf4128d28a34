"""The C2C fuser: projects a sharer's KV cache into a receiver's and gates it in per layer.

For every receiver layer ``n`` reading sharer layer ``G(n)``, and separately for keys and
values (a :class:`_Branch` each)::

    xs = flatten_heads(sharer_kv[G(n)])          # [B, N, Hs*Ds]   (aligned to receiver tokens)
    xt = flatten_heads(receiver_kv[n])           # [B, N, Ht*Dt]
    z  = blocks(Linear_in(concat(xs, xt)))       # [B, N, hidden]  residual MLP blocks
    P  = Linear_out(z)  -> [B, Ht, N, Dt]         # projected KV in the receiver's head layout
    w  = sigmoid(Linear_w(z)) -> [B, Ht, N, 1]   # dynamic weight, per token and per head
    g  = gate(layer, K|V)                        # Gumbel-sigmoid while training, 0/1 at inference
    out = receiver_kv[n] + g * w * P * mask      # mask: 1 on shared-context tokens only

A closed gate (hard 0) returns the receiver tensor itself: the cache stays bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

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


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class _Block(nn.Module):
    """x + Dropout(W2(GELU(W1(RMSNorm(x)))))."""

    def __init__(self, dim: int, inner: int, dropout: float):
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.up = nn.Linear(dim, inner, bias=False)
        self.down = nn.Linear(inner, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class _Branch(nn.Module):
    """The key (or value) branch of one receiver layer."""

    def __init__(self, cfg: FuserConfig):
        super().__init__()
        s, r = cfg.sharer, cfg.receiver
        inner = max(1, round(cfg.hidden_dim * cfg.intermediate_mult))
        self.heads = r.num_kv_heads
        self.head_dim = r.head_dim
        self.proj_in = nn.Linear(s.kv_dim + r.kv_dim, cfg.hidden_dim)
        self.blocks = nn.ModuleList(
            _Block(cfg.hidden_dim, inner, cfg.dropout) for _ in range(cfg.num_blocks)
        )
        self.norm_out = _RMSNorm(cfg.hidden_dim)
        self.proj_out = nn.Linear(cfg.hidden_dim, r.kv_dim)
        self.weight_head = nn.Linear(cfg.hidden_dim, r.num_kv_heads)
        self.gate_logit = nn.Parameter(torch.tensor(float(cfg.gate_init)))
        if cfg.zero_init:
            nn.init.zeros_(self.proj_out.weight)
            nn.init.zeros_(self.proj_out.bias)

    def delta(self, xs: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
        """Weighted projection ``w * P``.

        xs: [B, Hs, N, Ds] sharer KV aligned to receiver tokens; xt: [B, Ht, N, Dt].
        Returns [B, Ht, N, Dt].
        """
        b, _, n, _ = xt.shape
        flat_s = xs.transpose(1, 2).reshape(b, n, -1)  # [B, N, Hs*Ds]
        flat_t = xt.transpose(1, 2).reshape(b, n, -1)  # [B, N, Ht*Dt]
        z = self.proj_in(torch.cat([flat_s, flat_t], dim=-1))  # [B, N, h]
        for block in self.blocks:
            z = block(z)
        z = self.norm_out(z)
        proj = self.proj_out(z).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        weight = torch.sigmoid(self.weight_head(z)).transpose(1, 2).unsqueeze(-1)  # [B,Ht,N,1]
        return weight * proj


class Fuser(nn.Module):
    """One pair of K/V branches per receiver layer, with a per-(layer, K|V) gate.

    Invariants: ``config.layers[n]`` is the sharer layer read by receiver layer ``n``; with a
    closed gate, :meth:`fuse_layer` returns the receiver tensors unchanged (same objects).
    The temperature ``tau`` is set by the trainer via :meth:`set_step`.
    """

    def __init__(self, config: FuserConfig):
        super().__init__()
        self.config = config
        self.key_branches = nn.ModuleList(_Branch(config) for _ in config.layers)
        self.value_branches = nn.ModuleList(_Branch(config) for _ in config.layers)
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

    def gates(self) -> dict[str, list[bool]]:
        """Hard gate state per receiver layer (what inference uses)."""
        return {
            "key": [bool(b.gate_logit.item() > 0) for b in self._branches("key")],
            "value": [bool(b.gate_logit.item() > 0) for b in self._branches("value")],
        }

    def _branches(self, kind: str) -> list[_Branch]:
        mods = self.key_branches if kind == "key" else self.value_branches
        return [cast(_Branch, m) for m in mods]

    def _gate(self, branch: _Branch, like: torch.Tensor) -> torch.Tensor | None:
        """The gate for one branch; ``None`` means closed (skip the branch)."""
        mode = self.gate_mode
        if mode == "auto":
            mode = "soft" if self.training else "hard"
        if mode == "closed":
            return None
        if mode == "open":
            return like.new_ones(())
        if mode == "hard":
            return like.new_ones(()) if branch.gate_logit.item() > 0 else None
        # soft: binary-concrete relaxation, logistic noise = difference of two Gumbels,
        # one sample per (batch, head, token) as in the paper
        b, h, n, _ = like.shape
        u = torch.rand(b, h, n, 1, device=like.device, dtype=like.dtype).clamp_(1e-6, 1 - 1e-6)
        noise = torch.log(u) - torch.log1p(-u)
        return torch.sigmoid((branch.gate_logit.to(like.dtype) + noise) / self.tau)

    # -- fusion ------------------------------------------------------------------------
    def fuse_layer(
        self,
        layer: int,
        sharer_kv: tuple[torch.Tensor, torch.Tensor],
        receiver_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse one receiver layer.

        sharer_kv: ([B, Hs, N, Ds], ...) already aligned to the receiver's N tokens (layer
        ``config.layers[layer]`` of the sharer); receiver_kv: ([B, Ht, N, Dt], ...);
        mask: [B, N], 1.0 where a token is fused, 0.0 elsewhere (None = all tokens).
        """
        out = []
        for branch, xs, xt in (
            (self._branches("key")[layer], sharer_kv[0], receiver_kv[0]),
            (self._branches("value")[layer], sharer_kv[1], receiver_kv[1]),
        ):
            gate = self._gate(branch, xt)
            if gate is None:
                out.append(xt)
                continue
            delta = branch.delta(xs.to(xt.dtype), xt)
            if mask is not None:
                delta = delta * mask.to(xt.dtype)[:, None, :, None]
            out.append(xt + gate * delta)
        return out[0], out[1]

    def fuse(
        self,
        sharer_layers: list[tuple[torch.Tensor, torch.Tensor]],
        receiver_layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fuse every receiver layer; ``sharer_layers`` are already token-aligned."""
        if len(receiver_layers) != len(self.config.layers):
            raise ConfigError(
                f"fuser expects {len(self.config.layers)} receiver layers, "
                f"got {len(receiver_layers)}"
            )
        if len(sharer_layers) != self.config.sharer.num_layers:
            raise ConfigError(
                f"fuser expects {self.config.sharer.num_layers} sharer layers, "
                f"got {len(sharer_layers)}"
            )
        return [
            self.fuse_layer(n, sharer_layers[src], receiver_layers[n], mask)
            for n, src in enumerate(self.config.layers)
        ]

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


def describe_size(fuser: Fuser, sharer_params: int, receiver_params: int) -> dict[str, Any]:
    """Fuser parameter count next to the two models' (for reports)."""
    n = fuser.num_parameters()
    return {
        "fuser_params": n,
        "sharer_params": sharer_params,
        "receiver_params": receiver_params,
        "fuser_over_receiver": n / max(receiver_params, 1),
        "fuser_mb_fp32": n * 4 / 1e6,
        "log10_params": math.log10(max(n, 1)),
    }
