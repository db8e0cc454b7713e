"""The model's source code as a flat folder of files that import each other relatively — what Transformers' remote-code
loader copies for ``trust_remote_code=True`` — and the check that a user with only torch and transformers can load it.

The project's modeling files import their configuration as ``from flexformers.configuration.configuration_<x> import
...`` (the installed package), which does not exist on a user's machine. :func:`collect_remote_code` follows the
relative and project-absolute imports of the model and configuration files with :mod:`ast`, copies every file it
reaches and rewrites ``from flexformers.configuration.X import`` / ``from flexformers.modeling.X import`` (and the
namespace-less ``from configuration.X import`` form) to ``from .X import``; any other import that is not the
standard library, ``torch`` or ``transformers`` is an error, because it would fail on the user's side.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Top-level packages whose modules are copied into the flat folder (the remote code).
PROJECT_CODE_PACKAGES: tuple[str, ...] = ("modeling", "configuration")


#: The installed package those folders live under (``flexformers.modeling``, ``flexformers.configuration``).
PROJECT_NAMESPACE = "flexformers"


#: Third-party top-level modules remote code may import: torch, transformers and huggingface_hub, a hard
#: dependency of transformers (its configs use ``huggingface_hub.dataclasses.strict`` like ours).
REMOTE_CODE_THIRD_PARTY: frozenset[str] = frozenset({"torch", "transformers", "huggingface_hub"})


class ExportError(ValueError):
    """The checkpoint or the code cannot be exported; the message names the file (and line) at fault."""


@dataclasses.dataclass(frozen=True)
class _ImportEdge:
    """One import of a project file found in a source file: what it points to, and whether to rewrite it."""

    target: Path
    node: ast.ImportFrom
    rewrite_from: str | None  # the absolute (dotted) package to replace by "." (None: already relative)


def _allowed_top_level_modules() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) | REMOTE_CODE_THIRD_PARTY | {"__future__"}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path}:{getattr(node, 'lineno', '?')}"


def _project_imports(path: Path, tree: ast.AST, source_root: Path, packages: Sequence[str]) -> list[_ImportEdge]:
    """The imports of one file that point at project files; raises :class:`ExportError` for any import the
    flat remote folder cannot satisfy (third-party packages, package-level or multi-level relative imports)."""
    allowed = _allowed_top_level_modules()
    package_dir = path.parent
    edges: list[_ImportEdge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in packages or top == PROJECT_NAMESPACE:
                    raise ExportError(
                        f"{_where(path, node)}: `import {alias.name}` cannot be flattened for remote code; "
                        f"write `from {alias.name.rsplit('.', 1)[0]}.<module> import <Name>` instead"
                    )
                if top not in allowed:
                    raise ExportError(
                        f"{_where(path, node)}: remote code may import only the standard library, torch, transformers, "
                        f"huggingface_hub and the project's own {'/'.join(packages)} files, found `import {alias.name}`"
                    )
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
                parts = module.split(".")
                namespace = parts[:1] if parts[0] == PROJECT_NAMESPACE and len(parts) > 1 and parts[1] in packages else []
                top = parts[len(namespace)]
                if top in packages:
                    parts = parts[len(namespace):]
                    if len(parts) != 2:
                        raise ExportError(
                            f"{_where(path, node)}: `from {module} import ...` cannot be flattened for remote code; "
                            f"import from a module file, e.g. `from {top}.{top}_<name> import <Name>`"
                        )
                    target = source_root / parts[0] / f"{parts[1]}.py"
                    if not target.is_file():
                        raise ExportError(f"{_where(path, node)}: `from {module} import ...` but {target} does not exist")
                    edges.append(_ImportEdge(target=target, node=node, rewrite_from=".".join(namespace + parts[:1])))
                elif parts[0] == PROJECT_NAMESPACE:
                    raise ExportError(
                        f"{_where(path, node)}: `from {module} import ...` cannot be flattened for remote code; import "
                        f"from a module file, e.g. `from {PROJECT_NAMESPACE}.configuration.configuration_<name> import <Name>`"
                    )
                elif top not in allowed:
                    raise ExportError(
                        f"{_where(path, node)}: remote code may import only the standard library, torch, transformers, "
                        f"huggingface_hub and the project's own {'/'.join(packages)} files, found `from {module} import ...`"
                    )
            elif node.level == 1:
                if not node.module:
                    names = ", ".join(alias.name for alias in node.names)
                    raise ExportError(
                        f"{_where(path, node)}: `from . import {names}` is not followed by Transformers' remote-code "
                        f"loader (the module would not be copied); write `from .<module> import <Name>` instead"
                    )
                if "." in node.module:
                    raise ExportError(
                        f"{_where(path, node)}: `from .{node.module} import ...` imports a sub-package; remote code "
                        f"must be a flat set of files"
                    )
                target = package_dir / f"{node.module}.py"
                if not target.is_file():
                    raise ExportError(f"{_where(path, node)}: `from .{node.module} import ...` but {target} does not exist")
                edges.append(_ImportEdge(target=target, node=node, rewrite_from=None))
            else:
                raise ExportError(
                    f"{_where(path, node)}: `from {'.' * node.level}{node.module or ''} import ...` reaches outside "
                    f"its package; remote code must be a flat set of files"
                )
    return edges


def _rewrite_absolute_imports(source: str, edges: Iterable[_ImportEdge]) -> str:
    """Replace ``from <package>.X`` by ``from .X`` in the span of each import node, leaving everything else (the
    imported names, parentheses, comments, formatting) byte-for-byte unchanged."""
    lines = source.encode("utf-8").splitlines(keepends=True)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))
    data = source.encode("utf-8")
    spans = []
    for edge in edges:
        if edge.rewrite_from is None:
            continue
        node = edge.node
        # ast column offsets count UTF-8 bytes, hence the byte-level edit.
        start = line_starts[node.lineno - 1] + node.col_offset
        end = line_starts[node.end_lineno - 1] + node.end_col_offset
        spans.append((start, end, edge.rewrite_from))
    for start, end, package in sorted(spans, reverse=True):
        segment = data[start:end].decode("utf-8")
        dotted = r"\s*\.\s*".join(re.escape(part) for part in package.split("."))
        rewritten, count = re.subn(rf"^from\s+{dotted}\s*\.\s*", "from .", segment, count=1)
        if count != 1:
            raise ExportError(f"cannot rewrite import {segment!r}")
        data = data[:start] + rewritten.encode("utf-8") + data[end:]
    return data.decode("utf-8")


def collect_remote_code(
    root_files: Sequence[str | os.PathLike],
    source_root: str | os.PathLike | None = None,
    packages: Sequence[str] = PROJECT_CODE_PACKAGES,
) -> dict[str, str]:
    """The flat remote-code file set of ``root_files`` (a model file and its configuration file).

    Follows ``from .X import`` (same package) and ``from <package>.X import`` (another project package) imports
    transitively, anywhere in a file (also inside functions), and returns ``{file name: source}`` with the
    absolute project imports rewritten to ``from .X import``. Files are keyed by bare file name: two reachable
    files with the same name in different packages are an error, as is any import the flat folder cannot
    satisfy (see :func:`_project_imports`). ``source_root`` is the directory holding the packages (default: the
    parent of the first root file's package).
    """
    roots = [Path(path).resolve() for path in root_files]
    if not roots:
        raise ExportError("collect_remote_code needs at least one root file")
    root_dir = Path(source_root).resolve() if source_root is not None else roots[0].parent.parent
    for path in roots:
        if not path.is_file():
            raise ExportError(f"remote code file {path} does not exist")
        if path.parent.parent != root_dir or path.parent.name not in packages:
            raise ExportError(f"remote code file {path} is not in one of the packages {list(packages)} under {root_dir}")

    collected: dict[str, str] = {}
    origin: dict[str, Path] = {}
    pending = list(roots)
    while pending:
        path = pending.pop(0)
        name = path.name
        if name in origin:
            if origin[name] != path:
                raise ExportError(
                    f"file names must be unique across {'/'.join(packages)} for remote code: {origin[name]} and {path}"
                )
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
        except (OSError, UnicodeDecodeError, SyntaxError) as error:
            raise ExportError(f"cannot read remote code file {path}: {error}") from error
        edges = _project_imports(path, tree, root_dir, packages)
        origin[name] = path
        collected[name] = _rewrite_absolute_imports(source, edges)
        pending.extend(edge.target.resolve() for edge in edges)
    return collected


def check_flat_remote_code(folder: str | os.PathLike, entry_files: Sequence[str]) -> None:
    """Check a flat folder the way Transformers' remote-code loader will read it.

    Uses :mod:`transformers.dynamic_module_utils` itself: every file the loader will copy for each entry file
    (its recursive ``from .X import``) must exist, and every absolute import it will require must be the
    standard library, torch or transformers. Raises :class:`ExportError` otherwise.
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    folder = Path(folder)
    allowed = _allowed_top_level_modules()
    for entry in entry_files:
        pending, seen = [entry.removesuffix(".py")], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            path = folder / f"{name}.py"
            if not path.is_file():
                raise ExportError(
                    f"{entry}: Transformers' loader would copy {name}.py, which is not in the folder "
                    f"(a `from .{name} import` at the start of a line, possibly inside a docstring)"
                )
            foreign = sorted(set(get_imports(str(path))) - allowed)
            if foreign:
                raise ExportError(
                    f"{path.name}: Transformers' loader would require {foreign}, which a user with only "
                    f"torch and transformers does not have"
                )
            # The same regular expressions Transformers uses to decide which files to copy.
            pending.extend(get_relative_imports(str(path)))
