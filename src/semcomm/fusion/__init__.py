"""semcomm.fusion: cache-to-cache (C2C) fusion between two different models.

A trained :class:`Fuser` projects a sharer model's KV cache into a receiver model's cache, so
the receiver reads what the sharer understood of a shared context without any text being
generated. :func:`align_offsets` maps tokens between two tokenizers by character spans;
:class:`FusionTrainer` trains a fuser with both models frozen; :class:`FusionPipeline`
generates with the fused cache; :mod:`semcomm.fusion` evaluation compares receiver alone,
sharer alone, text-to-text and C2C (:func:`run_mcqa_eval` on a real pair and multiple-choice
files); :meth:`FusionPipeline.stream` yields the fused receiver's answer as text pieces. See
``docs/fusion.md``.
"""

from __future__ import annotations

from ._align import Alignment, EncodedPrompt, PromptParts, align_offsets, encode_prompt
from ._fuser import Fuser, FuserConfig, estimate_parameters
from ._io import load_fuser, read_fuser_config, save_fuser
from ._mcqa import (
    McqaSettings,
    MCQuestion,
    evaluate_mcqa,
    read_mcqa,
    run_mcqa_eval,
    shipped_pair_fuser_path,
)
from ._pipeline import FusionPipeline, Generation, ModelSide, greedy_decode, iter_greedy
from ._spec import LAYER_MAPPINGS, ModelSpec, layer_mapping, model_spec
from ._train import FusionExample, FusionTrainer, TrainConfig, TrainResult, read_examples

__all__ = [
    "LAYER_MAPPINGS",
    "Alignment",
    "EncodedPrompt",
    "Fuser",
    "FuserConfig",
    "FusionExample",
    "FusionPipeline",
    "FusionTrainer",
    "Generation",
    "MCQuestion",
    "McqaSettings",
    "ModelSide",
    "ModelSpec",
    "PromptParts",
    "TrainConfig",
    "TrainResult",
    "align_offsets",
    "encode_prompt",
    "estimate_parameters",
    "evaluate_mcqa",
    "greedy_decode",
    "iter_greedy",
    "layer_mapping",
    "load_fuser",
    "model_spec",
    "read_examples",
    "read_fuser_config",
    "read_mcqa",
    "run_mcqa_eval",
    "save_fuser",
    "shipped_pair_fuser_path",
]
