"""The checkout's shape and its documents: the root holds only what README.md names, config/README.md is the
schema's, every public function has a docstring, and every `module.name` the docs cite exists."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    listing = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return listing.stdout.splitlines()


def test_root_holds_only_what_the_readme_names():
    readme = (REPO_ROOT / "README.md").read_text()
    named = set(re.findall(r"`\.?([\w.-]+)/?`", readme)) | set(re.findall(r"\]\(([\w.-]+)\)", readme))
    root_entries = {path.split("/")[0] for path in _tracked_files()}
    unnamed = sorted(entry for entry in root_entries if entry.lstrip(".") not in named and entry not in named)
    assert not unnamed, f"tracked at the repository root but not named in README.md: {unnamed}"


SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
CONFIG_README = REPO_ROOT / "config" / "README.md"
TABLE_START, TABLE_END = "<!-- keys: start -->", "<!-- keys: end -->"


def _schema_keys(schema: dict) -> list[tuple[str, dict]]:
    """Every key of the sweep configuration, dotted (`<name>` for a key the user names), with its schema."""
    def resolve(node: dict) -> dict:
        while "$ref" in node:
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = {**schema["$defs"][node["$ref"].split("/")[-1]], **rest}
        return node

    def walk(node: dict, path: str) -> list[tuple[str, dict]]:
        node = resolve(node)
        keys = []
        for branch in [*node.get("oneOf", []), node.get("else", {})]:
            keys += walk(branch, path) if "properties" in resolve(branch) else []
        for key, sub in node.get("properties", {}).items():
            keys += [(path + key, resolve(sub)), *walk(sub, path + key + ".")]
        named = node.get("additionalProperties")
        if isinstance(named, dict) and ("properties" in resolve(named) or "else" in resolve(named)):
            keys += walk(named, path + ("<key>." if path.endswith("values.") else "<name>."))
        return keys

    return walk(schema, "")


def config_key_table() -> str:
    """config/README.md's table of keys, as the schema gives them."""
    import yaml

    def cell(text: object) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = ["| key | default | what it is |", "| --- | --- | --- |"]
    for key, node in _schema_keys(yaml.safe_load(SCHEMA.read_text())):
        default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
        rows.append(f"| `{key}` | {default} | {cell(node.get('description', ''))} |")
    return "\n".join(rows)


def test_config_readme_lists_every_schema_key_as_the_schema_describes_it():
    keys = _schema_keys(__import__("yaml").safe_load(SCHEMA.read_text()))
    undescribed = [key for key, node in keys if not node.get("description")]
    assert not undescribed, f"keys of {SCHEMA.name} without a description: {undescribed}"
    text = CONFIG_README.read_text()
    table = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip()
    assert table == config_key_table(), ("config/README.md's table differs from the schema; regenerate it with "
                                         "`python -m tests.test_repository` and paste it between the markers")


PACKAGE = REPO_ROOT / "nbsim"
DOCUMENTS = sorted((REPO_ROOT / "docs").glob("*.md")) + [REPO_ROOT / "README.md", CONFIG_README]
FILE_SUFFIXES = {"bin", "c", "cbf", "cfg", "cif", "csv", "geom", "h5", "hkl", "html", "img", "json", "log", "mat",
                 "md", "mtz", "nxs", "pdb", "pgm", "png", "pt2", "py", "rst", "smk", "so", "toml", "txt", "yaml",
                 "zarr"}


def _modules() -> dict[str, ast.Module]:
    def name(path):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    return {name(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_public_function_has_a_docstring():
    missing = []

    def visit(body, where):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if ast.get_docstring(node) is None:
                    missing.append(f"{where}{node.name}")
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{where}{node.name}.")

    for module, tree in _modules().items():
        visit(tree.body, f"{module}.")
    assert not missing, f"public functions without a docstring: {missing}"


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: functions, classes, assignments, imports, `self.x =` in its
    methods, and the names a module's lazy `__getattr__` serves (strings in its module-level tuples, or the
    keys of its module-level dict)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.FunctionDef):
                assigned = [target for statement in ast.walk(node) if isinstance(statement, ast.Assign)
                            for target in statement.targets]
                assigned += [statement.target for statement in ast.walk(node) if isinstance(statement, ast.AnnAssign)]
                names |= {target.attr for target in assigned if isinstance(target, ast.Attribute)
                          and isinstance(target.value, ast.Name) and target.value.id == "self"}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if isinstance(node.value, (ast.Tuple, ast.List, ast.Dict)):
                elements = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
                names |= {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _defined(node.body)
    return names


def test_every_name_the_docs_cite_exists():
    """Each `owner.name` in backticks (owner: a module, short as `plan` or as a path `kernel/cache`, a
    class, or a key of the sweep configuration) names something that exists: a module's function, class,
    constant or submodule, a class's method or field, a configuration key. File names are left alone."""
    import yaml

    modules = _modules()
    module_names = {module: _defined(tree.body) for module, tree in modules.items()}
    class_members: dict[str, list[set[str]]] = {}
    for tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                class_members.setdefault(node.name, []).append(_defined(node.body))
    config_keys = {key for key, _ in _schema_keys(yaml.safe_load(SCHEMA.read_text()))}

    def exists(token: str) -> bool | None:
        text = token.removesuffix("()").removeprefix("nbsim.")
        owner, _, name = text.rpartition(".")
        if name in FILE_SUFFIXES:
            return None
        if "/" not in owner and (text in config_keys or any(key.startswith(text + ".") for key in config_keys)):
            return True
        dotted = owner.replace("/", ".")
        found = [m for m in modules if m == f"nbsim.{dotted}" or m.endswith(f".{dotted}")]
        if found:
            return any(name in module_names[m] or f"{m}.{name}" in modules for m in found)
        if owner in class_members:
            return any(name in members for members in class_members[owner])
        return None

    missing = [f"{document.relative_to(REPO_ROOT)}: {token}" for document in DOCUMENTS
               for token in re.findall(r"`([^`\s]+)`", document.read_text())
               if re.fullmatch(r"[A-Za-z_][\w/]*(\.[A-Za-z_]\w*)+(\(\))?", token) and exists(token) is False]
    assert not missing, f"names cited in the docs that the code does not define: {missing}"



def test_every_source_file_the_docs_cite_exists():
    """A path in backticks under one of the repository's source folders (`nbsim/...`, `workflow/...`, or
    relative to nbsim/ as `kernel/cache.py`) names a file that exists; outputs (results/, tables/) are
    left alone."""
    folders = {"nbsim", "workflow", "config", "benchmarks", "tests", "docs", ".ci"}
    folders |= {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    missing = [f"{document.relative_to(REPO_ROOT)}: {token}" for document in DOCUMENTS
               for token in re.findall(r"`([\w.]+/[\w./-]+\.[a-z]+)`", document.read_text())
               if token.split("/")[0] in folders
               and not ((REPO_ROOT / token).exists() or (PACKAGE / token).exists())]
    assert not missing, f"files cited in the docs that do not exist: {missing}"


if __name__ == "__main__":
    print(config_key_table())


def test_a_folder_named_nbsim_does_not_shadow_the_installed_package(tmp_path):
    """A script run from the folder that holds a clone named `nbsim` imports the installed package, not the
    clone's folder as an empty namespace package (`module 'nbsim' has no attribute 'config_from_args'`): the
    editable install puts the checkout's root on sys.path (pyproject.toml's package-dir), where Python's own
    import finds the regular package over the namespace portion in the working directory."""
    holder, elsewhere = tmp_path / "holder", tmp_path / "elsewhere"
    holder.mkdir()
    elsewhere.mkdir()
    (holder / "nbsim").symlink_to(REPO_ROOT, target_is_directory=True)
    script = "import nbsim; print(nbsim.__file__, nbsim.config_from_args.__module__)"
    found = [subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True, timeout=120)
             for folder in (holder, elsewhere)]
    assert [done.returncode for done in found] == [0, 0], found[0].stderr[-500:]
    assert found[0].stdout == found[1].stdout and found[0].stdout.split()[0].endswith("__init__.py")
