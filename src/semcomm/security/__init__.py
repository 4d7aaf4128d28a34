"""Tenancy, sealing, integrity and probe detection. Other packages call into this one."""

from ._tenancy import (
    NO_TENANT_DIGEST,
    TenantId,
    TenantSalt,
    TenantSalter,
    load_server_secret,
    semcomm_home,
)

__all__ = [
    "NO_TENANT_DIGEST",
    "TenantId",
    "TenantSalt",
    "TenantSalter",
    "load_server_secret",
    "semcomm_home",
]
