"""The package's structure, as DESIGN.md draws it, checked by walking every module's imports (function-level
ones too): the dependency direction, no entry point imported by the library, no private name used across
modules, no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"deltafin": ROOT / "deltafin", "deltafin.coordinator": ROOT / "coordinator",
            "deltafin.worker": ROOT / "worker"}
ENTRY_POINTS = {"deltafin.cli.commands", "deltafin.__main__", "deltafin.coordinator.main", "deltafin.worker.main"}
# layer -> what it may not import (DESIGN.md: models -> weights -> stage -> transport -> worker / coordinator)
FORBIDDEN = {
    "deltafin.models": ("deltafin.weights", "deltafin.runtime.stage", "deltafin.runtime.pipeline", "deltafin.transport",
                        "deltafin.coordinator", "deltafin.worker"),
    "deltafin.weights": ("deltafin.runtime.stage", "deltafin.runtime.pipeline", "deltafin.transport", "deltafin.coordinator",
                         "deltafin.worker"),
    "deltafin.runtime.stage": ("deltafin.transport", "deltafin.coordinator", "deltafin.worker"),
    "deltafin.transport": ("deltafin.coordinator", "deltafin.worker"),
    "deltafin.worker": ("deltafin.coordinator",),
    "deltafin.coordinator": ("deltafin.worker",),
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            if "generated" in path.parts:
                continue
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            if package == "deltafin" and parts and parts[0] in ("coordinator", "worker"):
                continue
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("deltafin")]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])]) if node.level else node.module or ""
            if not target.startswith("deltafin"):
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                out.append((full, None, node.lineno) if full in MODULES else (target, a.name, node.lineno))
    return out


def test_layers_import_only_leftwards_and_the_library_no_entry_point() -> None:
    bad = []
    for name, path in MODULES.items():
        for target, _, line in _imports(name, path):
            if target in ENTRY_POINTS and name not in ENTRY_POINTS:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the entry point {target}")
            for layer, forbidden in FORBIDDEN.items():
                if (name == layer or name.startswith(layer + ".")) and target.startswith(forbidden):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {target}")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_module() -> None:
    bad = []
    for name, path in MODULES.items():
        aliases = set()
        for target, taken, line in _imports(name, path):
            if taken and taken.startswith("_") and not taken.startswith("__") and target != name:
                bad.append(f"{path.relative_to(ROOT)}:{line} takes {taken} from {target}")
            aliases.add((taken or target).rpartition(".")[2])
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = {name: {t for t, _, _ in _imports(name, path) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # a package's __init__ importing its own modules is not a cycle worth breaking; none of ours does
    assert not cycles, "\n".join(cycles)


def test_every_error_lives_in_errors_and_reaches_clients_by_its_tables() -> None:
    import grpc

    from deltafin import errors
    from deltafin.coordinator.http.server import _as_api_error
    from deltafin.transport.grpc_status import status_for

    defined = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for name, path in MODULES.items()
               if name != "deltafin.errors" for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "").endswith("Error") or
                                                          getattr(b, "id", "") == "DeltafinError" for b in node.bases)]
    assert not defined, "errors defined outside deltafin/errors.py:\n" + "\n".join(defined)
    assert status_for(errors.SessionNotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_for(errors.PrefixNotFound("x")) == grpc.StatusCode.ABORTED
    assert status_for(errors.CodecError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(ValueError("a bug")) == grpc.StatusCode.INTERNAL
    cases = [(errors.QueueFull("busy"), 429, "rate_limit_exceeded"),
             (errors.PromptTooLong("long"), 400, "context_length_exceeded"),
             (errors.ClusterUnavailable("gone"), 503, "cluster_unavailable"),
             (errors.RemoteError("w1", grpc.StatusCode.UNAVAILABLE, "down"), 503, "worker_unavailable"),
             (errors.WorkerLost("w1", 10.0), 503, "worker_unavailable"),
             (errors.SizingError("too big"), 500, None)]
    for error, status, code in cases:
        api = _as_api_error(error)
        assert (api.status, api.code) == (status, code), error
    assert _as_api_error(errors.ChatFormatError("bad roles")).param == "messages"
    assert _as_api_error(errors.SamplingError("top_p", "top_p must be in (0, 1]")).param == "top_p"


# the functions over 40 lines, and why each reads best whole
LONG_FUNCTIONS = {
    ("deltafin.text.chat", "render"): "the chat template's parts in the template's order, to read beside Kimi-K3.jinja",
    ("deltafin.checkpoint.config", "parse_config"): "one ModelConfig field per line, as config.json names it",
    ("deltafin.transport.discovery", "browse"): "zeroconf's listener, browser and their teardown share one lifetime",
    ("deltafin.cli.inspection", "inspect_model"): "the fields of `deltafin inspect`, each computed where it is named",
    ("deltafin.cli.inspection", "format_report"): "the report's lines in the order they are printed",
    ("deltafin.weights.store", "__init__"): "the slot pools, cache and reader, wired in the order they depend on",
    ("deltafin.coordinator.chat_cli", "run_chat"): "the terminal loop: input, commands, a turn Ctrl-C can stop",
    ("deltafin.coordinator.cluster.workers", "probe_workers"): "concurrent probes and every reason to leave a worker out",
    ("deltafin.coordinator.cluster.workers", "assign_plan"): "plan, parallel loads with progress, all clients closed on "
                                                     "failure: one transaction",
    ("deltafin.coordinator.main", "build_parser"): "the command line's table of commands and options",
}


def test_functions_are_short_and_the_long_ones_say_why() -> None:
    over_60, unexplained = [], []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
            if lines > 60:
                over_60.append(where)
            elif lines > 40 and (name, node.name) not in LONG_FUNCTIONS:
                unexplained.append(where)
    assert not over_60, "over 60 lines:\n" + "\n".join(over_60)
    assert not unexplained, "over 40 lines with no reason in LONG_FUNCTIONS:\n" + "\n".join(unexplained)


# tests/ beside the mirrored packages: what is not one module's test, each folder with its one purpose
TEST_FOLDERS = {
    "reference": "against independent implementations (transformers, llama.cpp)",
    "system": "real processes end to end: worker loss, soak, the full-width checkpoint under a memory cap",
    "platform": "the darwin branches (platform monkeypatched) and the CUDA path (on a GPU)",
    "support": "helpers the tests share: processes, hypothesis strategies, planned-vs-held sizes, registry files",
    "data": "fixture files",
}
MIRRORS = {"deltafin": ROOT / "deltafin", "coordinator": ROOT / "coordinator", "worker": ROOT / "worker"}


def test_tests_mirror_the_package() -> None:
    """tests/<package path>/test_<module>[_<aspect>].py for a module that exists there, so a module's tests are
    found where the module is; anything else lives in one of TEST_FOLDERS."""
    tests, bad = ROOT / "tests", []
    for folder in sorted(p for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if folder.name not in MIRRORS and folder.name not in TEST_FOLDERS:
            bad.append(f"tests/{folder.name}/ is neither a package mirror nor one of TEST_FOLDERS")
    for path in sorted(tests.rglob("test_*.py")):
        parts = path.relative_to(tests).parts
        if len(parts) == 1:
            if path.stem not in ("test_structure", "test_repo"):  # the repository itself
                bad.append(f"tests/{parts[0]}: a test at the top level that tests no module")
            continue
        if parts[0] not in MIRRORS:
            continue
        package = MIRRORS[parts[0]].joinpath(*parts[1:-1])
        modules = {p.stem for p in package.glob("*.py")} if package.is_dir() else set()
        words = path.stem.removeprefix("test_").split("_")
        if not any("_".join(words[:n]) in modules for n in range(len(words), 0, -1)):
            bad.append(f"{path.relative_to(ROOT)} names no module of {package.relative_to(ROOT)}/")
    assert not bad, "\n".join(bad)
