"""The layout's rules, read from the source (transfer/__init__.py says them).

- ``transfer/rules/`` is pure: no sockets, processes, threads or Twisted; nothing of ours above it.
- ``transfer/send/`` and ``transfer/receive/`` never import each other.
- A file named ``*host.py`` is a helper process (``python -m ...``), and nothing else
  under ``transfer/`` is.
- ``spark/`` reaches the transfer through two doors: ``send`` and ``receive`` (and the
  shared vocabulary in ``rules``, and ``machine`` for this machine's processes).
- Nothing under ``transfer/`` imports ``spark/`` (it installs and runs without Spark).
- No module imports another module's private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spark_dilation

ROOT = Path(spark_dilation.__file__).parent
TRANSFER = "spark_dilation.transfer"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import in ``path``, relative ones resolved."""
    module = _module(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.extend((target, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
    return found


def _sources(under: str = "") -> list[Path]:
    return sorted((ROOT / under).rglob("*.py"))


def _targets(path: Path) -> set[str]:
    """Every module ``path`` imports, with ``from package import module`` resolved."""
    out = set()
    for target, name in _imports(path):
        out.add(target)
        if name is not None and (ROOT.parent / (target + "." + name).replace(".", "/")).exists():
            out.add(f"{target}.{name}")
    return out


def test_rules_are_pure() -> None:
    banned = ("twisted", "socket", "subprocess", "crochet", "autobahn", "asyncio", "threading")
    allowed_ours = (f"{TRANSFER}.rules", "spark_dilation.errors", "spark_dilation.wormhole")
    problems = []
    for path in _sources("transfer/rules"):
        for target in _targets(path):
            if target.split(".")[0] in banned:
                problems.append((path.name, target))
            if target.startswith("spark_dilation") and not target.startswith(allowed_ours):
                problems.append((path.name, target))
    assert problems == []


def test_send_and_receive_never_import_each_other() -> None:
    problems = []
    for side, other in (("send", "receive"), ("receive", "send")):
        for path in _sources(f"transfer/{side}"):
            problems += [
                (side, path.name, t) for t in _targets(path) if t.startswith(f"{TRANSFER}.{other}")
            ]
    # Nor does what both sides share import either of them.
    for shared in ("transfer/meet", "transfer/link.py", "transfer/machine.py", "transfer/rules"):
        paths = [ROOT / shared] if shared.endswith(".py") else _sources(shared)
        for path in paths:
            problems += [
                (shared, path.name, t)
                for t in _targets(path)
                if t.startswith((f"{TRANSFER}.send", f"{TRANSFER}.receive", f"{TRANSFER}.api"))
            ]
    assert problems == []


def test_a_host_module_is_a_helper_process_and_only_it_is() -> None:
    hosts, mains = set(), set()
    for path in _sources("transfer"):
        text = path.read_text()
        if path.stem.endswith("host"):
            hosts.add(path.stem)
        if 'if __name__ == "__main__"' in text:
            mains.add(path.stem)
    assert hosts == {"senderhost", "lanehost", "registryhost", "streamhost"}
    assert mains == hosts


def test_spark_uses_the_two_doors() -> None:
    doors = (f"{TRANSFER}.send", f"{TRANSFER}.receive", f"{TRANSFER}.rules")
    problems = []
    for path in _sources("spark"):
        for target, name in _imports(path):
            if target == TRANSFER:
                target = f"{TRANSFER}.{name}"
            if target.startswith(TRANSFER) and not (
                target in (f"{TRANSFER}.send", f"{TRANSFER}.receive", f"{TRANSFER}.machine")
                or target.startswith(f"{TRANSFER}.rules.")
            ):
                problems.append((path.name, target))
    assert problems == [], doors


def test_the_transfer_does_not_import_the_spark_layer() -> None:
    problems = [
        (path.name, target)
        for path in _sources("transfer")
        for target in _targets(path)
        if target.startswith(("spark_dilation.spark", "pyspark"))
    ]
    assert problems == [("laneread.py", "pyspark")]  # TaskContext's attempt, if in a task


def test_no_module_imports_private_names_of_another() -> None:
    problems = []
    for path in _sources():
        for target, name in _imports(path):
            if name and name.startswith("_") and not name.startswith("__"):
                if target.startswith("spark_dilation") and target != _module(path):
                    problems.append((_module(path), target, name))
    assert problems == []
