"""semcomm.fusion: cache-to-cache (C2C) fusion between two different models.

A trained :class:`Fuser` projects a sharer model's KV cache into a receiver model's cache, so
the receiver reads what the sharer understood of a shared context without any text being
generated. :func:`align_offsets` maps tokens between two tokenizers by character spans;
:class:`FusionTrainer` trains a fuser with both models frozen (their prefills optionally
cached on disk, :class:`PrefillCache`); :class:`FusionPipeline`
generates with the fused cache; :mod:`semcomm.fusion` evaluation compares receiver alone,
sharer alone, text-to-text and C2C (:func:`run_mcqa_eval` on a real pair and multiple-choice
files; :func:`evaluate` with :class:`EvalSettings` on any :class:`MCItem` list);
:meth:`FusionPipeline.stream` yields the fused receiver's answer as text pieces;
:func:`load_side` loads a model side from a path spec. See ``docs/fusion.md``.
"""

from __future__ import annotations

from ._align import Alignment, EncodedPrompt, PromptParts, align_offsets, encode_prompt
from ._eval import EvalSettings, MCItem, evaluate, oracle_enrichment, plot_results
from ._fuser import Fuser, FuserConfig, estimate_parameters
from ._io import load_fuser, read_fuser_config, save_fuser
from ._mcqa import (
    METHODS,
    McqaSettings,
    MCQuestion,
    build_choice_rows,
    build_training_rows,
    c2c_mcqa_metric,
    evaluate_mcqa,
    evaluate_mcqa_receivers,
    find_pair_fuser,
    read_mcqa,
    run_mcqa_eval,
    shipped_pair_fuser_path,
    shipped_pair_fusers,
)
from ._pipeline import FusionPipeline, Generation, ModelSide, greedy_decode, iter_greedy
from ._prefill_cache import PrefillCache, PrefillCacheStats
from ._reference import load_side, shipped_fuser_path, split_template
from ._spec import LAYER_MAPPINGS, ModelSpec, layer_mapping, model_spec
from ._train import FusionExample, FusionTrainer, TrainConfig, TrainResult, read_examples

__all__ = [
    "LAYER_MAPPINGS",
    "METHODS",
    "Alignment",
    "EncodedPrompt",
    "EvalSettings",
    "Fuser",
    "FuserConfig",
    "FusionExample",
    "FusionPipeline",
    "FusionTrainer",
    "Generation",
    "MCItem",
    "MCQuestion",
    "McqaSettings",
    "ModelSide",
    "ModelSpec",
    "PrefillCache",
    "PrefillCacheStats",
    "PromptParts",
    "TrainConfig",
    "TrainResult",
    "align_offsets",
    "build_choice_rows",
    "build_training_rows",
    "c2c_mcqa_metric",
    "encode_prompt",
    "estimate_parameters",
    "evaluate",
    "evaluate_mcqa",
    "evaluate_mcqa_receivers",
    "find_pair_fuser",
    "greedy_decode",
    "iter_greedy",
    "layer_mapping",
    "load_fuser",
    "load_side",
    "model_spec",
    "oracle_enrichment",
    "plot_results",
    "read_examples",
    "read_fuser_config",
    "read_mcqa",
    "run_mcqa_eval",
    "save_fuser",
    "shipped_fuser_path",
    "shipped_pair_fuser_path",
    "shipped_pair_fusers",
    "split_template",
]
