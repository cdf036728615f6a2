"""Who may import whom (the matrix of docs/architecture.md), no import cycles, and the pure
layers loading without the bus.

The matrix, read off the source with an AST pass (every ``import`` anywhere in a module,
inside functions too, resolved to the module it names):

* ``schemas`` imports nothing of ours; ``bus`` imports ``schemas``; ``runtime`` imports
  ``schemas`` and ``bus``.
* The *shared service shell* — the top-level modules of ``services/`` that are not
  commands (``base``, ``lease``, ``jobstate``, ``client``, ``manifest`` …) and the
  ``services/auth/`` library (bus identities and permissions; it runs no service) —
  imports ``schemas``, ``bus`` and the shell.
* Each *service package* (every other package under ``services/``: admission, agent,
  checkpoint, elasticity, health …) imports ``schemas``, ``bus``, the shell and its own
  modules: never the runtime, never another service package's modules.
* The *command line* (:data:`CLI_MODULES`, their submodules, and every ``__main__``)
  may import anything, and nothing but the command line imports it.

No two modules may import each other, directly or round a loop; an import only under
``if TYPE_CHECKING:`` never runs, so it is no edge of a cycle (it is one of the matrix).
Within the packages of :data:`ACYCLIC_EVEN_FOR_TYPES` it is one: there modules import one
way only, for type hints too.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Top-level folders and the ``phalanx`` subpackage each one is (pyproject's package-dir).
PACKAGES = {"schemas": "phalanx.schemas", "bus": "phalanx.bus", "runtime": "phalanx.runtime",
            "services": "phalanx.services"}
#: The command line: the ``phalanx`` command (a package, one module per command group: its
#: submodules are the command line too), its live view, the local cluster behind
#: ``phalanx up`` and the tables they draw.
CLI_MODULES = ("phalanx.services.cli", "phalanx.services.top", "phalanx.services.cluster",
               "phalanx.services.tables")
#: Packages under services/ that are libraries of the shell, not services.
SHELL_PACKAGES = ("phalanx.services.auth",)
#: Which layers each layer may import (a service package: also its own modules).
ALLOWED = {
    "schemas": {"schemas"},
    "bus": {"schemas", "bus"},
    "runtime": {"schemas", "bus", "runtime"},
    "shell": {"schemas", "bus", "shell"},
    "service": {"schemas", "bus", "shell"},
}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``


def modules(root: Path) -> dict[str, Path]:
    """Every module of ours under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


@dataclasses.dataclass(frozen=True)
class Statement:
    """One ``import`` statement as written: ``from`` (``names``) or plain (``module``)."""

    line: int
    level: int  # the dots of a relative import
    module: str  # ``import a, b`` is two statements
    names: tuple[str, ...] | None  # ``from module import names``
    type_only: bool


@functools.cache
def statements(source: str) -> tuple[Statement, ...]:
    """The import statements of a module's ``source``; parsed once per text, as every
    test here reads the same tree (and its copies) again."""
    tree = ast.parse(source)
    type_only = _type_checking_lines(tree)
    found: list[Statement] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Statement(node.lineno, 0, alias.name, None, node.lineno in type_only)
                      for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(Statement(node.lineno, node.level, node.module or "",
                                   tuple(a.name for a in node.names),
                                   node.lineno in type_only))
    return tuple(found)


def imports(root: Path) -> list[Import]:
    """Every import of one of our modules by another, resolved: ``from pkg import name``
    names module ``pkg.name`` when that is a module, else ``pkg``."""
    known = modules(root)
    found = []
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for statement in statements(path.read_text()):
            if statement.names is None:
                targets = [statement.module]
            else:
                base = statement.module
                if statement.level:
                    anchor = package.split(".")[:len(package.split(".")) - statement.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{name}" if f"{base}.{name}" in known else base
                           for name in statement.names]
            found += [Import(module, t, statement.line, statement.type_only)
                      for t in targets if t.split(".")[0] == "phalanx" and t != module]
    return found


def packages(root: Path) -> set[str]:
    """The modules under ``root`` that are packages (an ``__init__.py``)."""
    return {m for m, path in modules(root).items() if path.name == "__init__.py"}


def layer(module: str, package_names: set[str]) -> str:
    """``schemas``, ``bus``, ``runtime``, ``shell``, ``cli`` or ``service:<package>``."""
    parts = module.split(".")
    if parts[-1] == "__main__" or any(module == m or module.startswith(m + ".")
                                      for m in CLI_MODULES):
        return "cli"
    if parts[1] != "services":
        return parts[1]
    if len(parts) == 2 or any(module == p or module.startswith(p + ".")
                              for p in SHELL_PACKAGES):
        return "shell"
    service = ".".join(parts[:3])
    return f"service:{service}" if service in package_names else "shell"


def breaches(root: Path) -> list[str]:
    """Every import the matrix forbids, as ``file:line: source (layer) -> target (layer)``."""
    known, package_names = modules(root), packages(root)
    found = []
    for i in imports(root):
        have, want = layer(i.source, package_names), layer(i.target, package_names)
        if have == "cli":
            continue
        allowed = ALLOWED["service" if have.startswith("service:") else have]
        if want in allowed or want == have:
            continue
        found.append(f"{known[i.source].relative_to(root)}:{i.line}: "
                     f"{i.source} ({have}) -> {i.target} ({want})")
    return found


def cycles(root: Path, *, type_only: bool = False) -> list[list[str]]:
    """The import cycles among our modules (strongly connected components of more than one
    module), imports under ``if TYPE_CHECKING:`` left out unless ``type_only``."""
    edges: dict[str, set[str]] = {m: set() for m in modules(root)}
    for i in imports(root):
        if (type_only or not i.type_only) and i.target in edges:
            edges[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in edges:
        if v not in index:
            visit(v)
    return found


# --- the tree as it is -----------------------------------------------------------------------


def test_every_import_keeps_the_matrix() -> None:
    assert breaches(ROOT) == []


def test_no_import_cycle() -> None:
    assert cycles(ROOT) == []


#: Packages whose modules import one way only, imports for type hints counted: each module
#: can be read, and tested, knowing only the modules below it.
ACYCLIC_EVEN_FOR_TYPES = (
    "phalanx.services.agent",
    # The session's parts take its state (phalanx.runtime.session_state), never the
    # session: not even an annotation loops back to it.
    "phalanx.runtime",
)


def cycles_within(root: Path, package: str) -> list[list[str]]:
    """The cycles, type-only imports counted, that run through a module of ``package``."""
    return [c for c in cycles(root, type_only=True)
            if any(m == package or m.startswith(package + ".") for m in c)]


@pytest.mark.parametrize("package", ACYCLIC_EVEN_FOR_TYPES)
def test_no_import_cycle_even_for_types(package: str) -> None:
    assert cycles_within(ROOT, package) == []


def test_the_layers_are_the_documented_ones() -> None:
    """The classification the matrix rests on, pinned for the modules the docs name."""
    names = packages(ROOT)
    assert layer("phalanx.schemas.snapshot_file", names) == "schemas"
    assert layer("phalanx.services", names) == "shell"
    assert layer("phalanx.services.base", names) == "shell"
    assert layer("phalanx.services.auth.credentials", names) == "shell"
    assert layer("phalanx.services.admission.core", names) == "service:phalanx.services.admission"
    assert layer("phalanx.services.admission", names) == "service:phalanx.services.admission"
    assert layer("phalanx.services.health.__main__", names) == "cli"
    assert {layer(m, names) for m in CLI_MODULES} == {"cli"}
    assert "phalanx.services.cli" in names  # a package under services/, yet no service
    assert layer("phalanx.services.cli.jobs", names) == "cli"


# --- the checker itself ----------------------------------------------------------------------


def _copy_of_the_tree(tmp_path: Path) -> Path:
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize(("path", "statement", "reported"), [
    ("services/agent/core.py", "from phalanx.runtime import durable",
     "phalanx.services.agent.core (service:phalanx.services.agent) -> "
     "phalanx.runtime.durable (runtime)"),
    ("services/elasticity/service.py", "from phalanx.services.admission import core",
     "phalanx.services.elasticity.service (service:phalanx.services.elasticity) -> "
     "phalanx.services.admission.core (service:phalanx.services.admission)"),
    ("schemas/messages.py", "import phalanx.bus.client",
     "phalanx.schemas.messages (schemas) -> phalanx.bus.client (bus)"),
    ("bus/kv.py", "from phalanx.services import lease",
     "phalanx.bus.kv (bus) -> phalanx.services.lease (shell)"),
    ("runtime/data.py", "from phalanx.services.agent.core import first_replica",
     "phalanx.runtime.data (runtime) -> phalanx.services.agent.core "
     "(service:phalanx.services.agent)"),
    ("services/lease.py", "from phalanx.services.health.core import HealthPolicy",
     "phalanx.services.lease (shell) -> phalanx.services.health.core "
     "(service:phalanx.services.health)"),
    ("services/agent/service.py", "from phalanx.services.cli import main",
     "phalanx.services.agent.service (service:phalanx.services.agent) -> "
     "phalanx.services.cli (cli)"),
])
def test_a_forbidden_import_added_to_the_tree_is_reported(
        tmp_path: Path, path: str, statement: str, reported: str) -> None:
    """Control: one forbidden import, added to a copy of the clean tree (inside a function,
    as a lazy import would be), is exactly what the check reports."""
    tree = _copy_of_the_tree(tmp_path)
    target = tree / path
    lines = target.read_text().splitlines()
    target.write_text("\n".join([*lines, "", "", "def _added() -> None:",
                                 f"    {statement}", ""]))
    assert breaches(tree) == [f"{path}:{len(lines) + 4}: {reported}"]


def test_the_command_line_may_import_anything(tmp_path: Path) -> None:
    tree = _copy_of_the_tree(tmp_path)
    with (tree / "services/top.py").open("a") as f:
        f.write("\nfrom phalanx.runtime import durable  # noqa\n")
    assert breaches(tree) == []


def test_a_cycle_is_reported_unless_one_side_imports_for_types_only(tmp_path: Path) -> None:
    """Control: ``phalanx top`` is a command of the CLI (its nodes group imports it, and
    ``up`` imports that group); an import back is a cycle, and the same import for type
    hints only is not."""
    tree = _copy_of_the_tree(tmp_path)
    top = tree / "services/top.py"
    source = top.read_text()
    top.write_text(source + "\nfrom phalanx.services.cli import main  # noqa\n")
    assert cycles(tree) == [["phalanx.services.cli", "phalanx.services.cli.nodes",
                             "phalanx.services.cli.up", "phalanx.services.top"]]
    top.write_text(source + "\nif TYPE_CHECKING:\n    from phalanx.services.cli import main\n")
    assert cycles(tree) == []
    assert cycles_within(tree, "phalanx.services.top") == [
        ["phalanx.services.cli", "phalanx.services.cli.nodes", "phalanx.services.cli.up",
         "phalanx.services.top"]]


def test_a_type_only_import_back_in_the_agent_is_a_cycle(tmp_path: Path) -> None:
    """Control: the warm spares' module importing the ranks' back, for type hints only, is
    reported for the agent."""
    tree = _copy_of_the_tree(tmp_path)
    spares = tree / "services/agent/spares.py"
    spares.write_text(spares.read_text() + "\nif TYPE_CHECKING:\n"
                      "    from phalanx.services.agent.ranks import RankSet\n")
    assert cycles(tree) == []
    assert cycles_within(tree, "phalanx.services.agent") == [
        ["phalanx.services.agent.ranks", "phalanx.services.agent.spares"]]


# --- the pure layers load without the bus ----------------------------------------------------

PURE_MODULES = sorted({
    "phalanx.schemas",
    "phalanx.schemas.messages",
    "phalanx.schemas.codec",
    "phalanx.schemas.subjects",
    "phalanx.schemas.environment",
    "phalanx.schemas.registry",
    "phalanx.schemas.replicas",
    "phalanx.schemas.scaling",
    "phalanx.schemas.snapshot_file",
    "phalanx.services.admission.policy",
    "phalanx.services.admission.changes",
    "phalanx.services.admission.events",
    "phalanx.services.admission.model",
    "phalanx.services.admission.lifecycle",
    "phalanx.services.admission.scheduling",
    "phalanx.services.admission.placement",
    "phalanx.services.admission.preemption",
    "phalanx.services.admission.explain",
    "phalanx.services.health.policy",
    "phalanx.services.health.progress",
    "phalanx.services.health.events",
    "phalanx.services.health.model",
    "phalanx.services.health.lifecycle",
    "phalanx.services.health.detect",
    "phalanx.services.health.cordon",
    "phalanx.services.health.outcome",
    "phalanx.services.health.crash",
    "phalanx.services.health.stored",
    "phalanx.services.elasticity.events",
    "phalanx.services.elasticity.phase",
    "phalanx.services.elasticity.model",
    "phalanx.services.elasticity.gang",
    "phalanx.services.elasticity.generations",
    "phalanx.services.elasticity.causes",
    "phalanx.services.elasticity.stored",
    "phalanx.services.elasticity.history",
    "phalanx.services.agent.priority",
    "phalanx.services.agent.reconcile",
    # the auth callout's rule, its JWTs and the rank tokens
    "phalanx.services.auth.callout",
    "phalanx.services.auth.nats_jwt",
    "phalanx.services.auth.rank_token",
    # every core.py
    *(m for m in modules(ROOT) if m.endswith(".core")),
})


def imported_after(module: str) -> set[str]:
    """Top-level package names in sys.modules after importing ``module`` in a fresh python."""
    code = (f"import sys, {module}\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_does_not_pull_in_nats_or_asyncio(module: str) -> None:
    loaded = imported_after(module)
    assert "phalanx" in loaded
    assert "nats" not in loaded
    assert "asyncio" not in loaded


def test_the_check_detects_the_bus_layer() -> None:
    """Control: the bus's client does import nats, so the check above is not vacuous."""
    loaded = imported_after("phalanx.bus.client")
    assert "nats" in loaded
    assert "asyncio" in loaded


def test_the_bus_loads_nats_without_aiohttp_which_stays_importable() -> None:
    """nats-py's websocket transport would import aiohttp (0.1-0.2 s of every process's
    start): the service, command and rank packages keep it out (:mod:`phalanx.bus.transport`)."""
    for module in ("phalanx.services.health.service", "phalanx.runtime.bus_thread",
                   "phalanx.services.client"):
        loaded = imported_after(module)
        assert "nats" in loaded and "aiohttp" not in loaded, module
    code = ("import phalanx.bus.client, aiohttp, nats.aio.transport as t; "
            "print(t.aiohttp is None, aiohttp.ClientSession.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.split() == ["True", "ClientSession"]


#: What a rank's start does not pay for unless its script uses it: torch's sharded
#: optimizer (FSDP and more come with it) and DCP, about 0.3 s of CPU each.
HEAVY_TORCH = ("torch.distributed.optim", "torch.distributed.checkpoint",
               "torch.distributed.fsdp")


def loaded_modules(code: str) -> set[str]:
    """Every module in sys.modules after running ``code`` in a fresh python."""
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_a_rank_loads_no_sharded_optimizer_or_dcp_it_does_not_use() -> None:
    loaded = loaded_modules("import phalanx.runtime, phalanx.runtime.elastic, "
                            "phalanx.examples.workload_w")
    assert not {m for m in loaded if m.startswith(HEAVY_TORCH)}
    # Control: building the sharded optimizer does load it, so the check is not vacuous.
    loaded = loaded_modules("import torch\nfrom phalanx.runtime import sharded_optimizer\n"
                            "sharded_optimizer([torch.zeros(1)], torch.optim.SGD, lr=0.1)")
    assert "torch.distributed.optim" in loaded
