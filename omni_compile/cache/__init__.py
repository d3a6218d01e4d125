"""Cache keys and shared stores for compiled region files (docs/cache.md)."""

from omni_compile.cache.key import KEY_SCHEMA, KeyFactors, device_arch
from omni_compile.cache.store import (
    CorruptEntryError,
    Entry,
    FileStore,
    RedisStore,
    Store,
    StoreError,
    StoreUnavailableError,
    open_store,
)

__all__ = [
    "KEY_SCHEMA",
    "CorruptEntryError",
    "Entry",
    "FileStore",
    "KeyFactors",
    "RedisStore",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "device_arch",
    "open_store",
]
