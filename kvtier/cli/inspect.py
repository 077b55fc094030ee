"""``kvtier inspect``: one record's header and checksum status, by key or by token ids."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

from kvtier.backends import Backend, EntryInfo
from kvtier.cli._common import (
    NotFoundError,
    UsageError,
    add_command,
    add_json_arg,
    ago,
    line,
    print_json,
    ratio,
    show,
    size,
    stdout_console,
    ts_seconds,
)
from kvtier.cli._store import (
    RECORD_PROBLEMS,
    check_record,
    find_key,
    namespace_from_description,
    open_store,
    parse_hex,
    problem,
    read_header,
    resolve_namespaces,
    snapshot,
)
from kvtier.codec import CODEC_NAMES, RecordHeader
from kvtier.errors import StoreError
from kvtier.fingerprint import weights_fingerprint
from kvtier.keys import (
    KEY_BYTES,
    RequestExtras,
    as_token_array,
    chain_seed,
    chunk_keys,
    partial_candidates,
)

EPILOG = """\
examples:
  kvtier inspect /data/kvcache 3fa2c1d0          a key, or any unique hex prefix of one
  kvtier inspect /data/kvcache --tokens prompt.json --model my-model
  kvtier inspect /data/kvcache --tokens ids.txt --namespace 9c1e --salt tenant-a

Keys are printed by 'kvtier verify' and 'kvtier inspect --tokens'. --tokens FILE holds the
token ids of a prompt (a JSON list, or integers separated by spaces, commas or newlines;
'-' reads stdin); kvtier hashes them as a server would and shows which chunks are cached.
cache_salt and LoRA are part of each key, so pass the request's --salt/--lora to find its
chunks. A vLLM server keys a LoRA request by the adapter's weights, not its name: give
--lora the adapter's directory (kvtier fingerprints its files as the server did), or the
'sha256:...' fingerprint; any other value is used as it is (what a library user passed as
RequestExtras.lora). Exit status 1 if a record inspected is corrupt or unreadable (not for
an incompatible one: intact, kept for the kvtier that can read it).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "inspect", help="show a record's header (shape, dtype, codec, sizes) and checksum status",
        description="Show one record's header and whether its checksum verifies, found by key "
                    "(or unique hex prefix) or by the token ids of a prompt.",
        epilog=EPILOG, run=run)
    p.add_argument("key", metavar="KEY", nargs="?", help="a record key in hex, or a unique prefix of one")
    p.add_argument("--tokens", metavar="FILE", help="find the chunks of these token ids instead of a key")
    p.add_argument("--namespace", metavar="HEXPREFIX", help="with --tokens: the namespace (see 'kvtier ls')")
    p.add_argument("--model", metavar="NAME", help="with --tokens: the namespace by model name")
    p.add_argument("--salt", metavar="SALT", help="with --tokens: the request's cache_salt")
    p.add_argument("--lora", metavar="DIR|FINGERPRINT",
                   help="with --tokens: the request's LoRA adapter (its directory, as the server loaded it)")
    add_json_arg(p)


def run(args: argparse.Namespace) -> int:
    if (args.key is None) == (args.tokens is None):
        raise UsageError("give either a KEY or --tokens FILE (see 'kvtier inspect --help')")
    if args.tokens is None and any(v is not None for v in (args.namespace, args.model, args.salt, args.lora)):
        raise UsageError("--namespace, --model, --salt and --lora go with --tokens FILE")
    if args.tokens is not None:
        return _run_tokens(args)
    return _run_key(args)


def _lora_identity(value: str | None) -> str | None:
    """What a request's keys hold for ``--lora``: an adapter directory (or weight file) is
    fingerprinted as the vLLM connector does; anything else is taken as it is."""
    if value is None:
        return None
    where = Path(value).expanduser()
    if not where.exists():
        if "/" in value:  # meant as the adapter's directory: a name has no slash
            raise UsageError(f"--lora: no such file or directory: {value}; give the directory the "
                             "server loaded the adapter from (or its sha256:... fingerprint)")
        return value
    try:
        return weights_fingerprint(where)
    except (FileNotFoundError, OSError) as exc:
        raise UsageError(f"--lora: cannot fingerprint the adapter at {value} ({exc}); give the "
                         "directory the server loaded it from") from None


# -- by key --------------------------------------------------------------------------
def _entry_of(backend: Backend, key: bytes, entries: list[EntryInfo] | None) -> EntryInfo | None:
    if entries is not None:
        return next((e for e in entries if e.key == key), None)
    return backend.lookup(key)


def _examine(backend: Backend, key: bytes) -> tuple[RecordHeader | None, str]:
    """``(header if readable, status)``; status is ``ok``, ``corrupt: ...`` etc."""
    try:
        header = check_record(backend, key)
    except RECORD_PROBLEMS as exc:
        kind, why = problem(exc)
        header = None
        if kind == "corrupt":
            with contextlib.suppress(*RECORD_PROBLEMS):
                header = read_header(backend, key)  # the header may be fine and the payload not
        return header, f"{kind}: {why}"
    if header is None:
        return None, "missing"
    return header, "ok"


def _failed(status: str) -> bool:
    """Whether a record's status is a failure (exit status 1): corrupt or unreadable. An
    incompatible record is intact (kept for the kvtier that can read it), as ``verify`` says."""
    return status.split(":", 1)[0] in ("corrupt", "unreadable")


def _header_json(h: RecordHeader) -> dict[str, Any]:
    return {
        "format_version": h.format_version, "codec": CODEC_NAMES.get(h.codec, str(h.codec)),
        "dtype": h.dtype_name, "layout": h.layout, "shape": list(h.shape),
        "token_start": h.token_start, "num_tokens": h.num_tokens,
        "created": ts_seconds(h.created_ns), "header_bytes": h.header_len,
        "raw_bytes": h.raw_len, "payload_bytes": h.payload_len, "record_bytes": h.record_len,
        "compression_ratio": ratio(h.raw_len, h.payload_len), "checksum_xxh3_128": h.checksum.hex(),
        "namespace": h.namespace_id.hex(),
    }


def _run_key(args: argparse.Namespace) -> int:
    with open_store(args.store) as st:
        full = len(parse_hex(args.key, "key")) == 2 * KEY_BYTES
        entries = None if full else snapshot(st.backend)  # a prefix: found among all keys
        key = find_key(entries, args.key)
        header, status = _examine(st.backend, key)
        entry = _entry_of(st.backend, key, entries)
        namespaces = st.backend.namespaces()
    if status == "missing":
        raise NotFoundError(f"no record with key {key.hex()} in {args.store}; it may have been evicted")
    desc = namespaces.get(header.namespace_id) if header else None
    out: dict[str, Any] = {
        "key": key.hex(), "status": status, "ok": status == "ok",
        "model": desc.get("model") if desc else None,
        "last_use": ts_seconds(entry.atime_ns) if entry else None,
        "stored_bytes": entry.size if entry else None,
        "header": _header_json(header) if header else None,
    }
    if args.json:
        print_json(out)
        return 1 if _failed(status) else 0
    con = stdout_console()
    t = Table(show_header=False, title=f"record {key.hex()[:16]}…", title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("key", key.hex())
    t.add_row("status", "[green]ok (checksum verified)[/]" if status == "ok" else f"[red]{escape(status)}[/]")
    if header:
        h = header
        t.add_row("namespace", f"{h.namespace_id.hex()}" + (f" ({escape(str(desc.get('model')))})" if desc else ""))
        t.add_row("format", f"v{h.format_version}, layout {h.layout} [layers, k/v, tokens, kv_heads, head_dim]")
        t.add_row("shape / dtype", f"{list(h.shape)} {h.dtype_name}")
        t.add_row("tokens", f"{h.token_start:,}–{h.token_start + h.num_tokens:,} ({h.num_tokens:,} tokens)")
        t.add_row("codec", CODEC_NAMES.get(h.codec, str(h.codec)))
        cr = ratio(h.raw_len, h.payload_len)
        t.add_row("sizes", f"header {h.header_len} B, payload {size(h.payload_len)} "
                  f"(raw {size(h.raw_len)}, ratio {cr:.2f}×), record {size(h.record_len)}")
        t.add_row("checksum", f"xxh3-128 {h.checksum.hex()}")
        created = dt.datetime.fromtimestamp(h.created_ns / 1e9).astimezone().isoformat(timespec="seconds")
        t.add_row("written", f"{created} ({ago(h.created_ns)})")
    if entry:
        t.add_row("last use", ago(entry.atime_ns))
    show(con, t)
    return 1 if _failed(status) else 0


# -- by token ids ----------------------------------------------------------------------
def read_tokens(spec: str) -> np.ndarray:
    """Token ids from a file (JSON list or integers separated by spaces/commas); '-' = stdin."""
    try:
        text = sys.stdin.read() if spec == "-" else Path(spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"--tokens {spec}: cannot read it ({why}); pass a readable file of token ids") from None
    ids: Any
    try:
        ids = json.loads(text)
        if isinstance(ids, dict):  # e.g. {"prompt_token_ids": [...]}
            ids = next((v for k, v in ids.items() if "token" in k and isinstance(v, list)), None)
    except ValueError:
        ids = [int(x) for x in re.split(r"[\s,]+", text.strip()) if x] if re.fullmatch(r"[\d\s,]*", text) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise UsageError(f"--tokens {spec}: expected token ids (a JSON list of integers, or integers "
                         "separated by spaces, commas or newlines)")
    try:
        return as_token_array(ids)
    except ValueError as exc:
        raise UsageError(f"--tokens {spec}: {exc}") from None


def _run_tokens(args: argparse.Namespace) -> int:
    tokens = read_tokens(args.tokens)
    with open_store(args.store) as st:
        descriptions = st.backend.namespaces()
        chosen = resolve_namespaces(st.root, (), descriptions,
                                    [args.namespace] if args.namespace else None,
                                    [args.model] if args.model else None)
        if not chosen:
            if len(descriptions) != 1:
                raise UsageError(f"{st.root} holds {len(descriptions)} namespaces; choose one with "
                                 "--namespace HEXPREFIX or --model NAME (see 'kvtier ls')")
            chosen = set(descriptions)
        if len(chosen) > 1:
            raise UsageError(f"{len(chosen)} namespaces match ({', '.join(sorted(i.hex()[:12] for i in chosen))}); "
                             "choose one with --namespace HEXPREFIX")
        ns_id = next(iter(chosen))
        if ns_id not in descriptions:
            raise UsageError(f"namespace {ns_id.hex()[:12]} is not registered; its key seed cannot be rebuilt")
        ns = namespace_from_description(descriptions[ns_id])
        if ns.id != ns_id:
            raise StoreError(f"namespace {ns_id.hex()[:12]}: its description does not hash to its id "
                             "(written by another kvtier version?)")
        seed = chain_seed(ns, RequestExtras(cache_salt=args.salt, lora=_lora_identity(args.lora)))
        rows: list[dict[str, Any]] = []
        prefix_end = 0
        contiguous = True
        parent = seed
        for ref in chunk_keys(tokens, seed, ns.chunk_tokens, None):
            header, status = _examine(st.backend, ref.key)
            rows.append({"start": ref.start, "end": ref.end, "key": ref.key.hex(), "status": status,
                         "bytes": header.record_len if header else None})
            if contiguous and status == "ok":
                prefix_end, parent = ref.end, ref.key
            else:
                contiguous = False
        if contiguous and prefix_end < len(tokens):
            for cand in partial_candidates(tokens, parent, prefix_end, ns.chunk_tokens, 1):
                header, status = _examine(st.backend, cand.key)
                if status != "missing":
                    rows.append({"start": cand.start, "end": cand.end, "key": cand.key.hex(),
                                 "status": status, "bytes": header.record_len if header else None})
                    if status == "ok":
                        prefix_end = cand.end
                    break
    corrupt = any(_failed(r["status"]) for r in rows)
    if args.json:
        print_json({"namespace": ns_id.hex(), "model": ns.model, "tokens": len(tokens),
                    "cached_prefix_tokens": prefix_end, "salt": args.salt is not None,
                    "lora": args.lora, "chunks": rows})
        return 1 if corrupt else 0
    con = stdout_console()
    t = Table(title=f"{len(tokens):,} tokens in namespace {ns_id.hex()[:12]} ({escape(ns.model)})",
              title_justify="left")
    for col in ("#", "tokens", "key", "size", "status"):
        t.add_column(col, justify="right" if col in ("#", "size") else "left")
    for i, r in enumerate(rows):
        st_txt = r["status"]
        colour = "green" if st_txt == "ok" else ("dim" if st_txt == "missing" else "red")
        t.add_row(str(i), f"{r['start']:,}–{r['end']:,}", r["key"][:16] + "…", size(r["bytes"]),
                  f"[{colour}]{escape(st_txt)}[/]")
    show(con, t)
    line(con, f"cached prefix: {prefix_end:,} of {len(tokens):,} tokens")
    return 1 if corrupt else 0
