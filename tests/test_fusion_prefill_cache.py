"""The on-disk cache of the frozen prefills (`fusion train --prefill-cache`): a step that reads
the KV back from disk has the loss of a step that computes it, the second pass reads every
example from disk, bad files are recomputed, and the CLI adds the cache on --resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.fusion import FusionTrainer, ModelSide, PrefillCacheStats, TrainConfig
from semcomm.fusion._mcqa import MCQuestion

from ._fusion_helpers import WORDS, _one_thread, word_examples  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair

FUSER: dict[str, Any] = {"hidden_dim": 16, "num_blocks": 1, "dropout": 0.0}


def questions(n: int = 6) -> list[MCQuestion]:
    out = []
    for i in range(n):
        w = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + i % 3)]  # prompts of 3 lengths
        out.append(MCQuestion(f"which is {' '.join(w)}?", (w[0], w[1] + " tower"), i % 2))
    return out


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # toy pair
    objective: str
    bf16: bool  # autocast: keys in fp32, values in bf16 (mixed dtypes in one file)


CASES = [Case("qwen", "answer", False), Case("cross", "choice", False), Case("qwen", "choice", True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c.kind}-{c.objective}-{c.bf16}")
def case(request) -> tuple[Case, ModelSide, ModelSide]:
    c = request.param
    pair = toy_pair(c.kind, seed=1)
    s = ModelSide(pair.sharer, pair.sharer_tokenizer, suffix=" answer:")
    r = ModelSide(pair.receiver, pair.receiver_tokenizer, prefix="context: ", suffix=" answer:")
    return c, s, r


def _trainer(case: tuple[Case, ModelSide, ModelSide], cache: Path | None, **kw: Any) -> FusionTrainer:
    c, s, r = case
    cfg = TrainConfig(
        steps=kw.pop("steps", 1), batch_size=4, lr=1e-2, warmup=1, checkpoint_every=0,
        objective=c.objective, bf16=c.bf16, fuser=FUSER,
    )
    data: Any = questions() if c.objective == "choice" else word_examples(6)
    tr = FusionTrainer(s, r, data, cfg, prefill_cache=cache, **kw)
    with torch.no_grad():  # open gates and a projection that changes the receiver's KV,
        tr.fuser.gate_logit.fill_(1.0)  # so that the sharer's KV reaches the loss
        tr.fuser.w_out.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    return tr


def _loss(tr: FusionTrainer) -> float:
    """The eval-mode loss over the 6 examples (batches of 4 and 2 prompts of different
    lengths, padded): each example's prefills are looked up once per model."""
    return tr.evaluate_loss()


def _close(case: tuple[Case, ModelSide, ModelSide], got: Any, want: Any) -> None:
    """Equal up to the noise of batching. A file holds an example's KV as computed in the
    batch it first came in; without the cache, an example's KV also varies with its batch
    (padding changes the matmul shapes): in fp32 by an ulp, under bf16 autocast by a bf16 ulp
    (up to 2e-3 on the toy models), which moves the loss by about 2e-4 relative."""
    tol = {"rtol": 1e-3, "atol": 1e-3} if case[0].bf16 else {}
    torch.testing.assert_close(got, want, **tol)


def _stats(tr: FusionTrainer) -> tuple[int, int, int]:
    assert tr.prefill_cache is not None
    st = tr.prefill_cache.stats
    return st.hits, st.misses, st.rewritten


def test_a_cached_step_has_the_loss_of_a_computed_step(case, tmp_path: Path) -> None:
    plain = _loss(_trainer(case, None))
    tr = _trainer(case, tmp_path)
    first = _loss(tr)  # computes and writes both models' prefills
    lookups = 2 * len(tr.encoded)  # sharer and receiver per example
    assert _stats(tr) == (0, lookups, 0)
    second = _loss(tr)  # reads them back
    assert _stats(tr) == (lookups, lookups, 0)
    _close(case, first, plain)
    _close(case, second, plain)
    # a fresh trainer (a resumed run) reads the files the first one wrote
    again = _trainer(case, tmp_path)
    _close(case, _loss(again), plain)
    assert _stats(again) == (lookups, 0, 0)
    # one folder per model variant (sharer and receiver), one file per example
    folders = list(tmp_path.iterdir())
    assert len(folders) == 2
    assert [len(list(f.glob("*.safetensors"))) for f in folders] == [len(tr.encoded)] * 2


def test_training_with_the_cache_takes_the_same_steps(case, tmp_path: Path) -> None:
    a = _trainer(case, None, steps=4).train()  # each trainer seeds torch when it is built
    cached = _trainer(case, tmp_path, steps=4)
    b = cached.train()
    assert a.prefill_cache is None
    _close(case, torch.tensor(b.losses), torch.tensor(a.losses))
    assert b.prefill_cache is not None and b.prefill_cache.hits > 0  # 6 examples, 16 drawn
    assert b.prefill_cache.hits + b.prefill_cache.misses == 2 * 4 * 4
    # validation (evaluate_loss) reads the cache too
    cached.evaluate_loss()
    assert _stats(cached)[0] > b.prefill_cache.hits


def _corrupt(files: list[Path], other: Path) -> None:
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    files[1].write_bytes(b"\x00" * 64)  # not safetensors
    shutil.copyfile(other, files[2])  # another example's KV (the ids do not match)
    files[3].unlink()  # missing


def test_bad_cache_files_are_recomputed(case, tmp_path: Path) -> None:
    plain = _loss(_trainer(case, None))
    tr = _trainer(case, tmp_path)
    _loss(tr)
    folder = max(tmp_path.iterdir(), key=lambda f: len(list(f.iterdir())))
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 6
    _corrupt(files, files[4])
    st0 = PrefillCacheStats(*_stats(tr))
    _close(case, _loss(tr), plain)
    hits, misses, rewritten = _stats(tr)
    assert (hits - st0.hits, misses - st0.misses, rewritten - st0.rewritten) == (8, 4, 3)
    # rewritten whole: the next pass reads every file
    _close(case, _loss(tr), plain)
    assert _stats(tr)[1] == misses and _stats(tr)[0] > hits


def test_cli_resume_adds_the_cache(tmp_path: Path) -> None:
    """--prefill-cache is not part of the run's config: a run started without it resumes
    with it, and the progress line reports hits and misses."""
    p = toy_pair("cross", seed=3)
    s_dir, r_dir = p.save(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"shared": e.shared, "answer": e.answer}) + "\n"
                            for e in word_examples(4)))
    out, cache = tmp_path / "fuser", tmp_path / "cache"
    args = ["fusion", "train", "--sharer", str(s_dir), "--receiver", str(r_dir), "--data",
            str(data), "--out", str(out), "--batch-size", "2", "--hidden", "8", "--blocks", "1",
            "--checkpoint-every", "1", "--threads", "1", "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--steps", "2"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, [*args, "--steps", "4", "--resume", "--prefill-cache", str(cache)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "train_state.json").read_text())["step"] == 4
    text = " ".join(res.output.split())
    assert "prefill cache" in text and "hits" in text and "misses" in text
    assert len(list(cache.glob("*/*.safetensors"))) > 0
