"""Tiny config-built models of every engine-supported family (2-4 layers, hidden 64, vocab 256).

Deterministic: ``tiny_model(name)`` seeds torch before building, so two processes get
identical weights (and therefore the same model fingerprint and chunk keys).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as T

VOCAB = 256
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (T.LlamaConfig, {"num_key_value_heads": 2}),
    "qwen2": (T.Qwen2Config, {"num_key_value_heads": 2}),
    "qwen3": (T.Qwen3Config, {"num_key_value_heads": 2, "head_dim": 16}),
    "mistral": (T.MistralConfig, {"num_key_value_heads": 2, "sliding_window": None}),
    "phi3": (T.Phi3Config, {"num_key_value_heads": 2}),
    "gemma": (T.GemmaConfig, {"num_key_value_heads": 2, "head_dim": 16}),
    "gpt2": (T.GPT2Config, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt_neox": (T.GPTNeoXConfig, {}),
    "opt": (T.OPTConfig, {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "falcon": (T.FalconConfig, {"alibi": False}),
    "falcon_alibi": (T.FalconConfig, {"alibi": True}),
    "olmo2": (T.Olmo2Config, {"num_key_value_heads": 2}),
    "granite": (T.GraniteConfig, {"num_key_value_heads": 2}),
    "stablelm": (T.StableLmConfig, {"num_key_value_heads": 2}),
}


WINDOW = 8
"""Sliding window of the SLIDING families: a query sees itself and 7 earlier positions."""

# Families with sliding-window layers (4 layers, so a Gemma3-style mix has both kinds).
SLIDING: dict[str, tuple[Any, dict[str, Any]]] = {
    "gemma3": (T.Gemma3TextConfig, {
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
    }),
    "mistral_sw": (T.MistralConfig, {"num_key_value_heads": 2, "sliding_window": WINDOW}),
    "qwen2_sw": (T.Qwen2Config, {"num_key_value_heads": 2, "num_hidden_layers": 4,
                                 "use_sliding_window": True, "sliding_window": WINDOW,
                                 "max_window_layers": 2}),
    "gemma2": (T.Gemma2Config, {"num_key_value_heads": 2, "head_dim": 16,
                                "sliding_window": WINDOW}),
}


def tiny_config(name: str, **overrides: Any) -> Any:
    cls, kw = FAMILIES[name] if name in FAMILIES else SLIDING[name]
    return cls(**{**_COMMON, **kw, **overrides})


def tiny_model(name: str = "qwen2", seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(name, **overrides))
    return model.eval()


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def reference_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's own greedy output without any cache (what the engine must match).

    Runs on the model's device (a CUDA model gets CUDA inputs).
    """
    x = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=False,
        pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


def greedy_margin(model: Any, ids: list[int], tokens: list[int]) -> float:
    """How far ``tokens`` are from being the model's own greedy continuation of ``ids``: the
    largest gap, over the steps, between the best logit and the chosen token's logit, with the
    model run once on ``ids + tokens`` (no cache). 0.0 where every token is the argmax; a small
    gap is a near-tie that another kernel's rounding may decide the other way."""
    if not tokens:
        return 0.0
    dev = next(model.parameters()).device
    x = torch.tensor([ids + tokens[:-1]], device=dev)
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()
    steps = logits[len(ids) - 1 :]
    chosen = steps.gather(1, torch.tensor(tokens, device=dev)[:, None])[:, 0]
    return float((steps.max(-1).values - chosen).max())


def assert_greedy_of(model: Any, ids: list[int], tokens: list[int], tol: float = 1e-4) -> None:
    """``tokens`` are the model's greedy continuation of ``ids``, up to near-ties within
    ``tol`` (float32 rounding differs between kernels and CPUs; bfloat16 needs a wider one)."""
    gap = greedy_margin(model, ids, tokens)
    assert gap <= tol, f"a generated token is {gap:.3g} below the model's best logit"
