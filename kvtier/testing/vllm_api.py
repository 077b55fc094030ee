"""Check kvtier's connector against a vLLM release's connector API, from its source text.

No vLLM install and no GPU: the files are read from the release's wheel (``pip download``,
about 340 MB for a CUDA build, fetched once and cached) and parsed with :mod:`ast`. This is
how CI sees an API change in the newest CUDA release before a user does.

    python -m kvtier.testing.vllm_api 0.33.0          # download, extract, check
    python -m kvtier.testing.vllm_api /path/to/site-packages   # an installed vLLM

What is checked:
* every abstract method of ``KVConnectorBase_V1`` and ``SupportsHMA`` is implemented;
* every method kvtier overrides accepts the parameters vLLM passes (same names, same order);
* the scheduler-output and KV-cache-spec fields kvtier reads still exist;
* the attention backends kvtier maps to a KV layout still exist under those names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SOURCES = (
    BASE,
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "vllm/v1/core/sched/output.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/attention/backends/flash_attn.py",
    "vllm/v1/attention/backends/flashinfer.py",
    "vllm/v1/attention/backends/triton_attn.py",
    "vllm/v1/attention/backends/cpu_attn.py",
)
CONNECTOR = Path(__file__).resolve().parent.parent / "vllm" / "connector.py"

# Attributes of vLLM objects the scheduler side and the geometry read: class -> names.
FIELDS_USED = {
    "vllm/v1/core/sched/output.py": {
        "SchedulerOutput": ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens"),
        "NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
        "CachedRequestData": ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"),
    },
    "vllm/v1/kv_cache_interface.py": {
        "KVCacheSpec": ("block_size",),
        "AttentionSpec": ("num_kv_heads", "head_size", "dtype"),
        "KVCacheGroupSpec": ("layer_names", "kv_cache_spec"),
        "KVCacheConfig": ("kv_cache_groups",),
    },
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": {
        "KVConnectorStats": ("data",),
    },
}


def fetch_release(version: str, cache_dir: Path) -> Path:
    """The source files above from vLLM ``version``'s wheel, under ``cache_dir/version``."""
    dest = cache_dir / version
    done = dest / ".complete"
    if done.exists():
        return dest
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "--disable-pip-version-check", "-q", "-d", tmp, f"vllm=={version}"], check=True)
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in SOURCES:
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(z.read(name))
    done.write_text(version)
    return dest


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _params(fn: ast.FunctionDef) -> tuple[list[str], int, bool]:
    """(positional-or-keyword names without self/cls, how many lack defaults, has **kwargs)."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args][1:]
    names += [a.arg for a in fn.args.kwonlyargs]
    pos = fn.args.posonlyargs + fn.args.args
    required = len(pos) - 1 - len(fn.args.defaults)
    required += sum(d is None for d in fn.args.kw_defaults)
    return names, required, fn.args.kwarg is not None


def _is_abstract(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "abstractmethod")
               or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod") for d in fn.decorator_list)


def _attributes(cls: ast.ClassDef) -> set[str]:
    out = set(_methods(cls))
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def api_problems(vllm_root: Path, connector: Path = CONNECTOR) -> list[str]:
    """Everything in vLLM's source at ``vllm_root`` that kvtier's connector does not fit."""
    problems: list[str] = []
    base_classes = _classes(vllm_root / BASE)
    ours = _methods(_classes(connector)["KVTierConnector"])
    for cname in ("KVConnectorBase_V1", "SupportsHMA"):
        if cname not in base_classes:
            problems.append(f"{BASE}: class {cname} is gone")
            continue
        for name, fn in _methods(base_classes[cname]).items():
            mine = ours.get(name)
            if mine is None:
                if _is_abstract(fn):
                    problems.append(f"{cname}.{name} is abstract and kvtier does not implement it")
                continue
            theirs, _, their_kwargs = _params(fn)
            names, required, my_kwargs = _params(mine)
            if names[: len(theirs)] != theirs:
                problems.append(f"{cname}.{name}{tuple(theirs)}: kvtier's takes {tuple(names)}")
            elif required > len(theirs):
                problems.append(f"{cname}.{name}: kvtier's requires parameters vLLM does not pass")
            if their_kwargs and not my_kwargs:
                problems.append(f"{cname}.{name} takes **kwargs; kvtier's does not")
    for rel, wanted in FIELDS_USED.items():
        classes = _classes(vllm_root / rel)
        for cname, attrs in wanted.items():
            if cname not in classes:
                problems.append(f"{rel}: class {cname} is gone")
                continue
            missing = [a for a in attrs if a not in _attributes(classes[cname])]
            if missing:
                problems.append(f"{rel}: {cname} no longer has {', '.join(missing)}")
    from kvtier.vllm.layout import BACKEND_CONTENT  # no vLLM import

    names = set()
    for rel in SOURCES:
        if "/attention/backends/" in rel:
            for m in ast.walk(ast.parse((vllm_root / rel).read_text())):
                if isinstance(m, ast.FunctionDef) and m.name == "get_name":
                    names.update(r.value.value for r in ast.walk(m)
                                 if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant))
    for backend in BACKEND_CONTENT:
        if backend not in names:
            problems.append(f"attention backend {backend} is gone (kvtier maps it to a KV layout)")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m kvtier.testing.vllm_api VERSION|SITE_PACKAGES_DIR", file=sys.stderr)
        return 2
    target = Path(args[0])
    if target.is_dir():
        root = target
        if not (root / BASE).is_file():
            print(f"{root}: no vLLM sources here (no {BASE}); give the site-packages directory that "
                  "holds the vllm package, or a vLLM version number", file=sys.stderr)
            return 2
    else:
        cache = Path(tempfile.gettempdir()) / "kvtier-vllm-api"
        cache.mkdir(exist_ok=True)
        try:
            root = fetch_release(args[0], cache)
        except (subprocess.CalledProcessError, OSError, KeyError, StopIteration) as exc:
            print(f"cannot fetch vLLM {args[0]}'s sources with pip: {exc}", file=sys.stderr)
            return 2
    problems = api_problems(root)
    for p in problems:
        print(p)
    print("kvtier's connector fits this vLLM's API" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
