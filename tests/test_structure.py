"""The package's structure, as the README's architecture section draws it, checked by walking every module's
imports (function-level ones too): each folder imports only the folders its rule allows (and its `__init__` says
so), the library below the entry points imports no entry point and no argparse, no class or module outgrows its
job, imports sit at the top unless a comment says why not, no two modules share a name, no private name is used
across modules, no import cycles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"deltafin": ROOT / "deltafin", "deltafin.coordinator": ROOT / "coordinator",
            "deltafin.worker": ROOT / "worker"}
# the entry points: the `deltafin` commands, the Python API facade, and each process's commands
ENTRY_FOLDERS = ("deltafin.cli",)
ENTRY_MODULES = {"deltafin", "deltafin.__main__", "deltafin.api"}
BASICS = "basics"  # deltafin's top-level library modules: errors, paths, devices, progress, options, expert_modes
# folder -> the folders its modules may import (besides its own); the README's architecture section says the same
LOW = {BASICS, "formats", "checkpoint"}
LIBRARY = LOW | {"text", "kernels", "models", "plan", "weights", "runtime", "transport"}
MAY_IMPORT = {
    BASICS: set(),
    "formats": {BASICS},
    "checkpoint": {BASICS, "formats"},
    "text": LOW,
    "kernels": LOW,
    "models": LOW | {"kernels"},
    "plan.memory": LOW | {"kernels", "models"},  # plan/'s rooms, each below the next (plan/__init__.py)
    "plan.cluster": LOW | {"kernels", "models", "plan.memory"},
    "plan.timing": LOW | {"kernels", "models", "plan.memory", "plan.cluster"},
    "plan": LOW | {"kernels", "models", "plan.memory", "plan.cluster", "plan.timing"},  # the deciders, on top
    "weights": LOW | {"kernels", "models", "plan"},
    "runtime": LOW | {"text", "kernels", "models", "plan", "weights"},
    "transport": LOW | {"kernels", "models", "plan", "weights", "runtime"},
    "download": LOW | {"plan"},
    "mini": LIBRARY - {"transport"},
    "coordinator": set(),  # its __init__: the folders below are the libraries
    "coordinator.cluster": LIBRARY,
    "coordinator.engine": LIBRARY | {"coordinator.cluster"},
    "coordinator.http": LIBRARY | {"coordinator.engine"},
    "worker": LIBRARY,
}
MAX_CLASS_LINES, MAX_MODULE_LINES = 250, 500


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


def is_entry_point(module: str) -> bool:
    """The entry points: deltafin/cli/ (every process's commands: `deltafin`, `deltafin-coordinator`,
    `deltafin-worker`), deltafin/__main__.py and deltafin/api.py. coordinator/ and worker/ hold only libraries."""
    return (module in ENTRY_MODULES or module in ENTRY_FOLDERS
            or module.startswith(tuple(f + "." for f in ENTRY_FOLDERS)))


def folder(module: str) -> str:
    """The layer a library module belongs to: its folder (coordinator's and worker's as coordinator.X, worker)."""
    parts = module.split(".")
    if parts[1] == "coordinator":
        return "coordinator." + parts[2] if len(parts) > 2 else "coordinator"  # the folder's own __init__
    if parts[1] == "worker":
        return "worker"
    if parts[1] == "plan" and len(parts) > 2 and MODULES[module].parent != PACKAGES["deltafin"] / "plan":
        return "plan." + parts[2]  # a room of plan/
    return parts[1] if MODULES[module].parent != PACKAGES["deltafin"] else BASICS


def may_import(layer: str, target: str) -> bool:
    """Whether a module of folder `layer` may import one of folder `target`: its own, or its rule's; a folder outside
    plan/ that may import plan may import each of its rooms (plan/'s own rules order the rooms)."""
    rule = MAY_IMPORT[layer]
    return (target == layer or target in rule
            or (target.startswith("plan.") and "plan" in rule and not layer.startswith("plan")))


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


def test_each_folder_imports_only_what_its_rule_allows_and_no_entry_point() -> None:
    bad = []
    for name, path in MODULES.items():
        if is_entry_point(name):
            continue
        layer = folder(name)
        for target, _, line in _imports(name, path):
            if target not in MODULES:
                target = target.rpartition(".")[0] if target.rpartition(".")[0] in MODULES else target
            if target not in MODULES or target == name:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if is_entry_point(target):
                bad.append(f"{where} imports the entry point {target}")
            elif not may_import(layer, folder(target)):
                bad.append(f"{where} ({layer}) imports {target} ({folder(target)})")
    assert not bad, "\n".join(bad)


def test_each_folder_says_what_it_holds_and_may_import() -> None:
    """Every folder's __init__ has a docstring; a library folder's ends with its rule, in MAY_IMPORT's words."""
    bad = []
    for name, path in MODULES.items():
        if path.name != "__init__.py" or name == "deltafin":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not doc:
            bad.append(f"{path.relative_to(ROOT)} has no docstring")
        if is_entry_point(name) or name in ("deltafin.coordinator", "deltafin.transport.generated"):
            continue
        said = re.search(r"May import: (.+)\.\Z", doc.strip(), re.S)
        allowed = {f.replace("basics", BASICS) for f in re.split(r",\s*|\s+and\s+", said.group(1))} if said else None
        allowed = {a for a in allowed or () if a and a != "nothing"} if said else None
        if allowed != MAY_IMPORT[folder(name)]:
            bad.append(f"{path.relative_to(ROOT)}: says it may import {allowed}, the rule is "
                       f"{sorted(MAY_IMPORT[folder(name)])}")
    assert not bad, "\n".join(bad)


def test_no_argparse_below_the_entry_points() -> None:
    """Options travel as typed values below the entry points: no argparse, no Namespace parameter."""
    bad = []
    for name, path in MODULES.items():
        if is_entry_point(name):
            continue
        text = path.read_text()
        if re.search(r"^\s*(import argparse|from argparse import)", text, re.M) or "Namespace" in text:
            bad.append(str(path.relative_to(ROOT)))
    assert not bad, "argparse below the entry points:\n" + "\n".join(bad)


def test_no_class_or_module_outgrows_its_job() -> None:
    bad = []
    for path in MODULES.values():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            bad.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines")
    assert not bad, f"over {MAX_CLASS_LINES} lines a class or {MAX_MODULE_LINES} a module:\n" + "\n".join(bad)


def test_imports_sit_at_the_top_unless_a_comment_says_why() -> None:
    """A function-level import is for what must load lazily (torch, MLX, grpc, a dev tool), and says so."""
    bad = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom) and \
                        "#" not in "".join(lines[node.lineno - 1:node.end_lineno]):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not bad, "function-level imports without a reason:\n" + "\n".join(bad)


def test_no_two_modules_share_a_name() -> None:
    """Module names say what a module is wherever it is imported (a package's __init__, __main__ and a process's
    main aside)."""
    seen: dict[str, list[str]] = {}
    for path in MODULES.values():
        if path.stem not in ("__init__", "__main__", "main"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


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


HTTP_ADAPTERS = "deltafin.coordinator.http."  # each API's adapter: <api>_api.py


def test_no_http_adapter_imports_another() -> None:
    """Each API's adapter (its requests in, its responses and errors out) reads the one generation request
    (coordinator/http/request.py) and depends on no other adapter, so that an API is added or changed alone."""
    adapters = {name: path for name, path in MODULES.items()
                if name.startswith(HTTP_ADAPTERS) and name.endswith("_api")}
    assert len(adapters) >= 4, sorted(adapters)  # OpenAI's, Anthropic's, Ollama's, the Responses API
    crossing = [f"{name} imports {target}" for name, path in adapters.items()
                for target, _, _ in _imports(name, path) if target in adapters and target != name]
    assert not crossing, "\n".join(crossing)


def test_every_error_lives_in_errors_and_reaches_clients_by_its_tables() -> None:
    import grpc

    from deltafin import errors
    from deltafin.coordinator.http.handling import as_api_error
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
        api = as_api_error(error)
        assert (api.status, api.code) == (status, code), error
    assert as_api_error(errors.ChatFormatError("bad roles")).param == "messages"
    assert as_api_error(errors.SamplingError("top_p", "top_p must be in (0, 1]")).param == "top_p"


# the functions over 40 lines, and why each reads best whole
LONG_FUNCTIONS = {
    ("deltafin.coordinator.engine.token_loop", "generate"): "a request's decode loop: the state its steps share "
    "(what the stages hold, what was fed, the drafts in flight) and its one release, in the order they happen",
    ("deltafin.coordinator.cluster.backend", "forward"): "the stages' calls, their relays, the features they answer "
    "and a failure's resume point share one loop",
    ("deltafin.text.chat", "render"): "the chat template's parts in the template's order, to read beside Kimi-K3.jinja",
    ("deltafin.checkpoint.config", "parse_config"): "one ModelConfig field per line, as config.json names it",
    ("deltafin.transport.discovery", "browse"): "zeroconf's listener, browser and their teardown share one lifetime",
    ("deltafin.cli.inspection", "inspect_model"): "the fields of `deltafin inspect`, each computed where it is named",
    ("deltafin.cli.inspection", "format_report"): "the report's lines in the order they are printed",
    ("deltafin.cli.terminal_chat", "_chat"): "the terminal loop: input, commands, a turn Ctrl-C can stop",
    ("deltafin.coordinator.cluster.workers", "probe_workers"): "concurrent probes and every reason to leave a "
                                                               "worker out",
    ("deltafin.coordinator.cluster.workers", "assign_plan"): "plan, parallel loads with progress, all clients "
                                                             "closed on failure: one transaction",
    ("deltafin.cli.coordinator", "build_parser"): "the command line's table of commands and options",
    ("deltafin.plan.timing.predict", "_wide_layers"): "one MoE layer's model over every holder: its share, "
                                                      "reads, compute, rows' crossing and read-ahead, each a list "
                                                      "over the holders",
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
    "support": "helpers the tests share: processes, hypothesis strategies, planned-vs-held sizes, registry files, "
               "a weight format of their own",
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
            if path.stem not in ("test_structure", "test_repo", "test_packaging"):  # the repository itself
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


FORMAT_HOME = "deltafin.formats"  # the registry of weight formats: one module a format
HEADER_SKIP = ("body", "orelse", "finalbody", "handlers")  # a compound statement's nested statements


def _header_nodes(stmt: ast.stmt) -> list[ast.AST]:
    """The expressions of a statement itself, its nested statements left out (an if's test, not its body)."""
    out = []
    for field in stmt._fields:
        if field in HEADER_SKIP:
            continue
        value = getattr(stmt, field)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, ast.AST) and not isinstance(v, ast.stmt):
                out += list(ast.walk(v))
    return out


def _about_a_dtype_or_wire(nodes: list[ast.AST]) -> bool:
    """A statement about an activation dtype or the wire: it names the other dtype/wire ("fp32"), or an
    identifier, keyword or string of it contains dtype, wire or bfloat16."""
    words = [n.id for n in nodes if isinstance(n, ast.Name)] + [n.attr for n in nodes if isinstance(n, ast.Attribute)]
    words += [n.arg or "" for n in nodes if isinstance(n, ast.keyword)]
    words += [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return "fp32" in words or any(k in w.lower() for w in words for k in ("dtype", "wire", "bfloat16"))


def test_format_names_appear_only_in_the_registry() -> None:
    """A weight format is named as a string only in its own module under deltafin/formats (and in tests): the
    planner, the converter, the kernels and the command line ask the registry (deltafin.formats), or import a
    format's object where the code is that format's own (MLX's MXFP4 mode, the q4 matmuls on MLX).

    The rule, by the syntax tree: outside deltafin/formats, no string constant equals a registered format's name
    (prose that mentions one, a docstring or a help text, is a longer string and passes). One exception: a name
    that is also an activation dtype or a wire name (options.DTYPES, options.WIRES: "bf16") may stand in a
    statement about a dtype or the wire, one whose own expressions (an if's test, an assignment, a return, a call's
    arguments; not the statements nested in it) name "fp32" too, or an identifier, keyword or string containing
    dtype, wire or bfloat16: `options.wire == "bf16"`, `DTYPES = ("fp32", "bf16")`."""
    from deltafin.formats import registered
    from deltafin.options import DTYPES, WIRES

    names = {f.name for f in registered()}
    also_dtypes = names & (set(DTYPES) | set(WIRES))
    assert {"bf16", "int8", "q4", "mxfp4"} <= names and also_dtypes == {"bf16"}
    bad = []
    for name, path in MODULES.items():
        if name == FORMAT_HOME or name.startswith(FORMAT_HOME + "."):
            continue
        for stmt in ast.walk(ast.parse(path.read_text())):
            if not isinstance(stmt, ast.stmt):
                continue
            nodes = _header_nodes(stmt)
            for node in nodes:
                if not (isinstance(node, ast.Constant) and node.value in names):
                    continue
                if node.value in also_dtypes and _about_a_dtype_or_wire(nodes):
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} names the format {node.value!r}")
    assert not bad, "format names outside deltafin/formats (ask the registry):\n" + "\n".join(bad)


ENTRY = re.compile(r"^( *)([a-z_]+/)(?= )")  # a folder's entry in the file map: its name at its depth


def _file_map() -> dict[str, str]:
    """docs/architecture.md's file map: each folder's entry text (its lines until the next folder's), by path."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    stack: list[str] = []
    current = None
    for line in block.splitlines():
        m = ENTRY.match(line)
        if m and len(m.group(1)) % 2 == 0 and len(m.group(1)) < 20:
            depth = len(m.group(1)) // 2
            stack = [*stack[:depth], m.group(2)]
            current = "".join(stack)
            entries[current] = line[m.end():]
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_the_architecture_file_map_names_every_module_and_only_modules_that_exist() -> None:
    """Every module of the packages is named in its folder's entry of docs/architecture.md's file map, and every
    `name.py` an entry names is a module of that folder."""
    entries, bad = _file_map(), []
    folders = {path.parent.relative_to(ROOT).as_posix() + "/" for path in MODULES.values()}
    for folder_path in sorted(folders):
        text = entries.get(folder_path)
        names = {p.name for p in (ROOT / folder_path).glob("*.py") if p.name != "__init__.py"}
        if text is None:
            if names:
                bad.append(f"{folder_path}: no entry in the file map")
            continue
        bad += [f"{folder_path}{n}: not in the file map" for n in sorted(names)
                if not re.search(rf"\b{re.escape(n)}\b", text)]
        bad += [f"{folder_path}{n}: named by the file map, not in the folder"
                for n in sorted(set(re.findall(r"\b([a-z_0-9]+\.py)\b", text)) - names)]
    assert not bad, "\n".join(bad)


OUR_FOLDERS = {"deltafin", "coordinator", "worker", "tests", "docs", "proto", "deploy", "tools", *MAY_IMPORT,
               *(f.split(".")[-1] for f in MAY_IMPORT), "cli", "engine", "cluster", "http", "memory", "timing"}
PATH_REF = re.compile(r"(?<![\w./-])((?:[a-z_0-9]+/)+[a-z_0-9]+\.(?:py|proto|md|c))\b")


def test_the_code_and_the_proto_name_only_files_that_exist() -> None:
    """A path in a docstring, comment or the proto (`plan/memory/sizing.py`) names a file of the repository: from the
    root, from deltafin/ or the file's own folder (a path into another project is not ours to check)."""
    sources = [*MODULES.values(), *(ROOT / "proto").glob("*.proto")]
    bad = []
    for path in sources:
        for ref in PATH_REF.findall(path.read_text()):
            if ref.split("/")[0] not in OUR_FOLDERS:
                continue
            if not any((base / ref).exists() for base in (ROOT, ROOT / "deltafin", path.parent)):
                bad.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not bad, "\n".join(bad)


def test_the_planner_and_the_processes_commands_load_without_torch() -> None:
    """plan/ is pure: every module of it, and the worker's and the coordinator's commands with their flags, import
    without torch or gRPC (a plan is made and `deltafin-worker --help` or `deltafin-coordinator --help` printed at
    once), and so do the values a stage reports (StageStats)."""
    plan = sorted(m for m in MODULES if m.startswith("deltafin.plan"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in [*plan, "deltafin.runtime.worker_stats"])
            + "from deltafin.cli.worker import build_parser\nbuild_parser().format_help()\n"
            + "from deltafin.cli.coordinator import build_parser\nbuild_parser().format_help()\n"
            + "print(sorted(m for m in ('torch', 'grpc', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert len(plan) > 20 and out.stdout.strip() == "[]", out.stdout + out.stderr
