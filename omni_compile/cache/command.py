"""`omni-compile cache ls|push|pull|rm|gc`: its options and the command (the CLI module only wires them in).

`ls` prints its listing on stdout (a table, or JSON with --json); push, pull, rm and gc report what they did
on stderr, like every progress line and note. Only `push` creates a store: for the others, a `file://`
store whose directory does not exist is an empty store, and they say so (docs/cache.md#commands).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omni_compile.cache.store import FileStore, Store, StoreError, open_store
from omni_compile.errors import ConfigError

MIN_PREFIX = 8
KEY_HELP = (f"a key is the 64 hex characters `cache ls --json` prints, or a unique prefix of at least {MIN_PREFIX} "
            "of them such as the 16 `cache ls` shows")  # fmt: skip


def add_arguments(p) -> None:
    p.add_argument("action", choices=["ls", "push", "pull", "rm", "gc"])
    p.add_argument("targets", nargs="*", help="push/pull: an artifact directory; rm: cache keys or unique prefixes "
                   f"of at least {MIN_PREFIX} characters (as `cache ls` shows)")  # fmt: skip
    p.add_argument("--store", required=True, metavar="URL", help="file://PATH or redis://[:PASSWORD@]HOST:PORT/DB")
    p.add_argument("--max-age-days", type=float, help="gc: also remove entries older than this")
    p.add_argument("--json", action="store_true", help="ls: print the entries as JSON on stdout")


def run(args, console) -> int:
    store = open_store(args.store)
    absent = _absent(store)
    if args.action == "ls":
        if absent:
            _say(console, f"note: {absent}; a build with --store or `omni-compile cache push` creates it")
        return _ls(store, args.json)
    if args.action == "gc":
        if absent:
            _say(console, f"note: {absent}; nothing to collect")
        removed = store.gc(None if args.max_age_days is None else args.max_age_days * 86400)
        _say(console, f"{store.url}: removed " + ", ".join(f"{n} {k}" for k, n in removed.items()))
        return 0
    if args.action == "rm":
        return _rm(store, args.targets, absent, console)
    if len(args.targets) != 1:
        raise ConfigError(f"cache {args.action} needs one artifact directory")
    return _transfer(store, args.action, Path(args.targets[0]), absent, console)


def _say(console, text: str) -> None:
    """One line on stderr, never wrapped or read as markup (URLs and paths are long and may hold brackets)."""
    console.print(text, soft_wrap=True, markup=False, highlight=False)


def _absent(store: Store) -> str:
    """Why a file:// store is empty without looking ('' when its directory exists); a file in its place is an error."""
    if not isinstance(store, FileStore) or store.root.is_dir():
        return ""
    if store.root.exists():
        raise StoreError(f"{store.url}: {store.root} is not a directory; a file:// store is a directory")
    return f"{store.url}: the store directory does not exist"


def _ls(store: Store, as_json: bool) -> int:
    entries = store.list()
    if as_json:
        print(json.dumps([{"key": e.key, "size": e.size, "sha256": e.sha256, "created": e.created, "meta": e.meta}
                          for e in entries], indent=2))  # fmt: skip
        return 0
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.created))
        print(f"{e.key[:16]}  {e.size / 2**20:8.2f} MiB  {when}  {e.meta.get('label', '')}".rstrip())
    print(f"{len(entries)} entries, {sum(e.size for e in entries) / 2**20:.1f} MiB in {store.url}")
    return 0


def _rm(store: Store, targets: list[str], absent: str, console) -> int:
    if not targets:
        raise ConfigError(f"cache rm needs one or more cache keys: {KEY_HELP}")
    keys = list(dict.fromkeys(_resolve(store, t, absent) for t in targets))  # every target first: all or nothing
    gone = 0
    for key in keys:
        if store.delete(key):
            _say(console, f"removed {key}")
            gone += 1
        else:  # removed by someone else since it was resolved
            _say(console, f"{key}: already gone")
    _say(console, f"removed {gone} of {len(keys)} entries")
    return 0 if gone == len(keys) else 1


def _resolve(store: Store, target: str, absent: str) -> str:
    """The one key `target` names: itself, or the only key it is a prefix of (of at least MIN_PREFIX characters)."""
    try:
        matches = store.keys(target)
    except ConfigError:
        raise ConfigError(f"invalid cache key {target!r}: {KEY_HELP}") from None
    if target in matches:
        return target
    if len(target) < MIN_PREFIX:
        raise ConfigError(f"cache key {target!r} is too short: {KEY_HELP}")
    if not matches:
        where = f" ({absent})" if absent else ""
        raise ConfigError(f"no entry in {store.url} has a key starting with {target!r}{where}; "
                          "see `omni-compile cache ls`")  # fmt: skip
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (f" and {len(matches) - 5} more" if len(matches) > 5 else "")
        raise ConfigError(f"cache key prefix {target!r} is ambiguous: it matches {len(matches)} entries ({shown}); "
                          "give more of the key")  # fmt: skip
    return matches[0]


def _transfer(store: Store, action: str, root: Path, absent: str, console) -> int:
    """push: publish the artifact's files (checked against its manifest first); pull: fetch the missing or
    damaged ones."""
    from omni_compile.artifact.manifest import read_manifest, sha256_file

    manifest = read_manifest(root)
    files = [e for e in manifest.files() if e.cache_key]
    if not files:
        raise ConfigError(f"{root}: its manifest has no cache keys (built before stores existed); rebuild it")
    done = 0
    for e in files:
        path = root / e.file
        if action == "push":
            if not path.is_file() or sha256_file(path) != e.sha256:
                raise ConfigError(f"{root}: {e.file} is missing or fails its checksum; not pushing a bad file")
            meta = {"label": e.file, "graph_hash": e.graph_hash, "passes": e.passes, "pytree": e.pytree}
            done += store.put(e.cache_key, path.read_bytes(), meta)
        else:
            if path.is_file() and sha256_file(path) == e.sha256:
                continue
            entry = store.get(e.cache_key)
            if entry is None or entry.sha256 != e.sha256:
                where = f" ({absent})" if absent else ""
                raise ConfigError(f"{store.url} has no entry for {e.file} matching the manifest's sha256{where}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(entry.data)
            done += 1
    verb = "pushed" if action == "push" else "pulled"
    _say(console, f"{verb} {done} of {len(files)} files ({store.url})")
    return 0
