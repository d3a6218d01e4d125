"""One build's use of a shared store: look up before compiling, publish after, never fail the build.

Every store failure becomes a warning: an unreachable or failing store is not asked again during this
build (one timeout, not one per region), a corrupt entry is compiled locally and then replaced
(repaired) in the store. The summary (hits, misses, published, repaired, errors, bytes moved) goes
into the build's manifest and report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

from omni_compile.cache.store import CorruptEntryError, Entry, Store, StoreError, open_store

logger = logging.getLogger("omni_compile.cache")


@dataclass
class StoreStats:
    url: str
    hits: int = 0
    misses: int = 0
    published: int = 0
    repaired: int = 0
    errors: list[str] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = round(d["seconds"], 3)
        return d


class StoreSession:
    def __init__(self, url: str, warn: Callable[[str], None] | None = None):
        self.warn_fn = warn or logger.warning  # the CLI passes its console
        self.store: Store | None = None
        self.stats = StoreStats(url=url)
        self._corrupt: set[str] = set()
        try:
            self.store = open_store(url)
            self.stats.url = self.store.url  # without a password
        except StoreError as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        msg = f"store {self.stats.url}: {e}; building locally without it"
        self.stats.errors.append(str(e))
        self.store = None
        self.warn_fn(msg)

    def fetch(self, key: str, identity: str | None = None) -> Entry | None:
        """The verified entry of `key`, or None. An entry stored for another region graph than
        `identity` (the key covers it, so only a bad writer makes one) is treated like a corrupt one."""
        if self.store is None:
            return None
        t0 = time.perf_counter()
        try:
            entry = self.store.get(key)
            if entry is not None and identity is not None and entry.meta.get("region_identity") != identity:
                raise CorruptEntryError(f"{self.stats.url}: entry {key} was stored for another graph")
        except CorruptEntryError as e:
            self._corrupt.add(key)
            self.stats.errors.append(str(e))
            msg = f"{e}; compiling it here and replacing the entry"
            self.warn_fn(msg)
            entry = None
        except StoreError as e:
            self._fail(e)
            entry = None
        self.stats.seconds += time.perf_counter() - t0
        if entry is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.bytes_down += entry.size
        return entry

    def publish(self, key: str, data: bytes, meta: dict[str, Any]) -> None:
        if self.store is None:
            return
        t0 = time.perf_counter()
        repair = key in self._corrupt
        try:
            if self.store.put(key, data, meta, replace=repair):
                self.stats.published += 1
                self.stats.bytes_up += len(data)
                self.stats.repaired += int(repair)
        except StoreError as e:
            self._fail(e)
        self.stats.seconds += time.perf_counter() - t0
