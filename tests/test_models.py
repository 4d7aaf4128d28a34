"""The model catalog: digests are the trust boundary, conversion is faithful, names resolve.

The synthetic tests build small wheels of their own (a corrupted byte, a wrong size, a
truncated wheel must each be refused, with nothing left behind); the real-model tests use the
pulled catalog models (``make test`` pulls them first).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from semcomm.errors import IntegrityError, InvalidInputError
from semcomm.models import (
    CATALOG,
    CatalogEntry,
    WheelPart,
    assemble_gguf,
    catalog_entry,
    is_catalog_name,
    is_pulled,
    load_gguf,
    model_path,
    resolve_model,
    verify,
)

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
needs_smol = pytest.mark.skipif(not is_pulled(SMOL), reason=f"{SMOL} is not pulled")


# ------------------------------------------------------------------ catalog
def test_catalog_entries_are_consistent() -> None:
    assert {SMOL, QWEN, "gemma-3-270m"} <= set(CATALOG)
    for e in CATALOG.values():
        assert sum(p.size for p in e.parts) == e.size, e.name
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert all("==" in r for r in e.requirements)
        assert e.hub_id.count("/") == 1


def test_names_and_aliases_resolve_and_unknown_names_are_clear() -> None:
    assert catalog_entry("SmolLM2-135M-Instruct").name == SMOL
    assert catalog_entry("qwen2.5-coder").name == QWEN
    assert is_catalog_name(SMOL) and not is_catalog_name("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(InvalidInputError, match="known: smollm2-135m-instruct"):
        catalog_entry("llama-7b")
    # a hub id or a local path passes through unchanged
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model("/some/local/dir") == "/some/local/dir"


# ------------------------------------------------- assembling from wheels
def _fake_entry(tmp: Path, datas: list[bytes], *, sha: str | None = None) -> tuple[CatalogEntry,
                                                                                  list[Path]]:
    wheels, parts = [], []
    for i, data in enumerate(datas):
        w = tmp / f"fake_part{i}-1.0-py3-none-any.whl"
        member = f"fake_part{i}/data/part{i}.bin"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(member, data)
        wheels.append(w)
        parts.append(WheelPart(f"fake-part{i}", "1.0", member, len(data)))
    whole = b"".join(datas)
    entry = CatalogEntry(name="fake", family="llama", kind="base", hub_id="x/fake", license="-",
                         gguf_file="fake.gguf", sha256=sha or hashlib.sha256(whole).hexdigest(),
                         size=len(whole), parts=tuple(parts))
    return entry, wheels


def _rewrite_member(wheel: Path, member: str, data: bytes) -> None:
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, data)


def test_assembly_concatenates_parts_in_order_and_checks_the_digest(tmp_path: Path) -> None:
    datas = [os.urandom(3000), os.urandom(1000), os.urandom(17)]
    entry, wheels = _fake_entry(tmp_path, datas)
    out = assemble_gguf(entry, wheels, tmp_path / "out" / "fake.gguf")
    assert out.read_bytes() == b"".join(datas)
    with pytest.raises(InvalidInputError, match="needs 3 wheels"):
        assemble_gguf(entry, wheels[:2], tmp_path / "o2" / "fake.gguf")


@pytest.mark.parametrize("damage", ["flipped byte", "wrong size", "truncated wheel", "no member"])
def test_a_damaged_source_is_refused_and_nothing_is_left(tmp_path: Path, damage: str) -> None:
    datas = [os.urandom(4096), os.urandom(4096)]
    entry, wheels = _fake_entry(tmp_path, datas)
    member = entry.parts[1].member
    if damage == "flipped byte":  # a valid wheel with other bytes: only the digest can tell
        bad = bytearray(datas[1])
        bad[1234] ^= 0x01
        _rewrite_member(wheels[1], member, bytes(bad))
        match = "SHA-256"
    elif damage == "wrong size":
        _rewrite_member(wheels[1], member, datas[1] + b"x")
        match = "catalog expects 4,096"
    elif damage == "truncated wheel":
        raw = wheels[1].read_bytes()
        wheels[1].write_bytes(raw[: len(raw) // 2])
        match = "not a readable wheel|damaged"
    else:
        _rewrite_member(wheels[1], "other/file.bin", datas[1])
        match = "has no member"
    target = tmp_path / "out" / "fake.gguf"
    with pytest.raises(IntegrityError, match=match):
        assemble_gguf(entry, wheels, target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no partial file either


# ------------------------------------------------------------- real models
@needs_smol
def test_verify_checks_the_real_digest_and_refuses_a_corrupted_copy(tmp_path: Path) -> None:
    rep = verify(SMOL)
    assert rep.ok, rep.problems
    entry = catalog_entry(SMOL)
    assert entry.gguf_file in rep.checked and "model.safetensors" in rep.checked
    # a copy of the pulled model with one flipped byte in the GGUF and one in the weights
    src = model_path(SMOL, pull_missing=False).parent
    home = tmp_path / "models"
    shutil.copytree(src, home / SMOL, ignore=shutil.ignore_patterns(".lock", "wheels"))
    for rel in (f"gguf/{entry.gguf_file}", "hf/model.safetensors"):
        p = home / SMOL / rel
        with open(p, "r+b") as fh:
            fh.seek(1_000_000)
            b = fh.read(1)
            fh.seek(1_000_000)
            fh.write(bytes([b[0] ^ 0x80]))
    bad = verify(SMOL, home=home)
    assert not bad.ok
    text = " ".join(bad.problems)
    assert entry.sha256 in text and "model.safetensors" in text
    env = dict(os.environ, SEMCOMM_MODELS=str(home))
    proc = subprocess.run([sys.executable, "-m", "semcomm.cli", "models", "verify", SMOL],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "FAIL" in proc.stdout, proc.stdout + proc.stderr


@needs_smol
def test_converted_directory_gives_the_gguf_logits() -> None:
    """The converted safetensors directory is the GGUF load, weight for weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = catalog_entry(SMOL)
    hf = model_path(SMOL, pull_missing=False)
    g_model, g_tok = load_gguf(hf.parent / "gguf" / entry.gguf_file)
    c_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    c_tok = AutoTokenizer.from_pretrained(hf)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = c_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
    g_ids = g_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
    assert torch.equal(ids, g_ids)  # same tokenizer and chat template
    with torch.no_grad():
        a = g_model(ids).logits
        b = c_model(ids).logits
    assert torch.equal(a, b)
    out = c_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False)
    assert "Paris" in c_tok.decode(out[0, ids.shape[1]:])


@needs_smol
def test_models_path_prints_a_directory_transformers_loads_offline() -> None:
    """The contract: `semcomm models path NAME` prints a directory for from_pretrained."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "semcomm.cli", "models", "path", SMOL], env=env,
                          capture_output=True, text=True, check=True)
    path = proc.stdout.strip()
    assert Path(path, "config.json").exists() and Path(path, "tokenizer.json").exists()
    code = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(type(m).__name__, t.chat_template is not None)")
    out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["LlamaForCausalLM", "True"]


@needs_smol
def test_engine_and_cli_accept_catalog_names() -> None:
    from semcomm import HFEngine

    eng = HFEngine(SMOL, store=None)
    r = eng.generate([{"role": "user", "content": "What is the capital of France?"}],
                     max_new_tokens=8)
    assert "Paris" in (r.text or "")
