"""The checkout's shape: the root holds only what README.md names, and no test writes into the checkout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

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


if __name__ == "__main__":
    print(config_key_table())
