"""Every field of the config schema is read by code outside megagrpo/config: no knob silently does nothing.

The check is static, over the AST of megagrpo/ (without megagrpo/config), launch/ and tools/ (without the
docs generator, which reads every field by reflection). A field counts as read when its name is loaded as
an attribute (or through `getattr(x, "name")`) on an expression that denotes its section. Which section an
expression denotes is resolved from what the code itself says:
  * an attribute named after a section field (`cfg.algo.tis` denotes `tis`);
  * a variable assigned from such an expression (`a = cfg.algo`), bound by a `for` over one (`for f in
    cfg.rewards.functions`, `for name, spec in (("tis", a.tis), ...)`), or named like the field (`auto`);
  * a parameter or assignment annotated with the section's class (`def f(cfg: SyntheticConfig)`).
A field name that only one section class uses needs no resolution: reading `.heldout_fraction` anywhere
reads `data.heldout_fraction`. A name that several classes use (`enabled`, `dtype`, `window`, `lr`...)
must be read on its own section. Adding a field that no code reads fails here.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from megagrpo.config.loader import _section_of
from megagrpo.config.schema import Config

REPO = Path(__file__).resolve().parents[3]
READERS = ("megagrpo", "launch", "tools")
NOT_READERS = (REPO / "megagrpo" / "config", REPO / "tools" / "gen_config_docs.py")


def schema_fields(model: type[BaseModel] = Config, prefix: str = ""):
    """(dotted path, owning section class, the field under which that class sits, leaf name)."""
    parent = prefix.rstrip(".").rsplit(".", 1)[-1] or None
    for name, f in model.model_fields.items():
        yield f"{prefix}{name}", model, parent, name
        section = _section_of(f.annotation)
        if section is not None:
            yield from schema_fields(section, f"{prefix}{name}.")


def _annotation(path: str):
    model: type[BaseModel] = Config
    for part in path.split(".")[:-1]:
        model = _section_of(model.model_fields[part].annotation)
    return model.model_fields[path.rsplit(".", 1)[-1]].annotation


SECTION_CLASSES = {owner.__name__ for _, owner, _, _ in schema_fields()}
SECTION_FIELDS = {
    path.rsplit(".", 1)[-1] for path, _, _, _ in schema_fields() if _section_of(_annotation(path))
}


class _Reads(ast.NodeVisitor):
    """Attribute loads of one module with the set of section keys (field or class names) each receiver
    may denote."""

    def __init__(self, signatures: dict[str, list[str]]) -> None:
        self.alias: dict[str, set[str]] = defaultdict(set)
        self.reads: list[tuple[str, ast.expr]] = []
        self.signatures = signatures  # function or class name in this module -> its parameters

    def denotes(self, e: ast.expr) -> set[str]:
        if isinstance(e, ast.Attribute):
            return {e.attr} & SECTION_FIELDS
        if isinstance(e, ast.Name):
            return ({e.id} & SECTION_FIELDS) | self.alias.get(e.id, set())
        if isinstance(e, ast.Subscript):  # cfg.rewards.functions[0]
            return self.denotes(e.value)
        return set()

    def bind(self, target: ast.expr, value: ast.expr | None, iterating: bool = False) -> None:
        if isinstance(target, ast.Name) and value is not None:
            self.alias[target.id] |= self.denotes(value)
        elif isinstance(target, ast.Tuple):
            rows = [value]
            if iterating and isinstance(value, (ast.Tuple, ast.List)):
                rows = list(value.elts)  # for a, b in ((x1, y1), (x2, y2)): bind each row
            for row in rows:
                if isinstance(row, (ast.Tuple, ast.List)) and len(row.elts) == len(target.elts):
                    for t, v in zip(target.elts, row.elts):
                        self.bind(t, v)

    def annotate(self, name: str, ann: ast.expr | None) -> None:
        if ann is None:
            return
        names = {n.id for n in ast.walk(ann) if isinstance(n, ast.Name)}
        names |= {n.value for n in ast.walk(ann) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        names |= {n.attr for n in ast.walk(ann) if isinstance(n, ast.Attribute)}
        self.alias[name] |= names & SECTION_CLASSES

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self.bind(t, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.annotate(node.target.id, node.annotation)
            self.bind(node.target, node.value)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._iterate(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._iterate(node.target, node.iter)
        self.generic_visit(node)

    def _iterate(self, target: ast.expr, it: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.alias[target.id] |= self.denotes(it)  # for f in cfg.rewards.functions
        else:
            self.bind(target, it, iterating=True)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            self.annotate(arg.arg, arg.annotation)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            self.reads.append((node.attr, node.value))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        params = self.signatures.get(node.func.id) if isinstance(node.func, ast.Name) else None
        if params is not None:  # a parameter denotes what this module's callers pass to it
            for name, arg in zip(params, node.args):
                self.alias[name] |= self.denotes(arg)
            for kw in node.keywords:
                if kw.arg in params:
                    self.alias[kw.arg] |= self.denotes(kw.value)
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                self.reads.append((key.value, node.args[0]))
        self.generic_visit(node)


def reader_files() -> list[Path]:
    out = []
    for top in READERS:
        for p in sorted((REPO / top).rglob("*.py")):
            if not any(p == x or x in p.parents for x in NOT_READERS):
                out.append(p)
    return out


def _signatures(tree: ast.Module) -> dict[str, list[str]]:
    """Positional parameters of the module's functions and (through __init__) classes, without self."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            out.setdefault(node.name, [a.arg for a in args if a.arg not in ("self", "cls")])
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    out[node.name] = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs][1:]
    return out


def collect_reads(files: list[Path]) -> dict[str, list[set[str]]]:
    """leaf name -> the receiver keys of every read of it (three passes, so that aliases bound later in
    the file, and aliases of aliases, resolve too)."""
    reads: dict[str, list[set[str]]] = defaultdict(list)
    for p in files:
        tree = ast.parse(p.read_text(), filename=str(p))
        v = _Reads(_signatures(tree))
        for _ in range(3):
            v.reads.clear()
            v.visit(tree)
        for name, receiver in v.reads:
            reads[name].append(v.denotes(receiver))
    return reads


def unread_fields(reads: dict[str, list[set[str]]]) -> list[str]:
    classes_of: dict[str, set[str]] = defaultdict(set)
    for _, owner, _, name in schema_fields():
        classes_of[name].add(owner.__name__)
    missing = []
    for path, owner, parent, name in schema_fields():
        seen = reads.get(name, [])
        if len(classes_of[name]) == 1:
            ok = bool(seen)
        else:
            want = {owner.__name__} | ({parent} if parent else set())
            ok = any(keys & want for keys in seen)
        if not ok:
            missing.append(path)
    return missing


def test_every_schema_field_is_read_outside_the_config_package():
    missing = unread_fields(collect_reads(reader_files()))
    assert not missing, (
        f"config fields no code reads (a knob that silently does nothing): {missing}; read them where "
        "they take effect, or remove them from megagrpo/config/schema.py"
    )


def test_the_check_finds_an_unread_field(tmp_path):
    """The check has teeth: reading a shared name on the wrong section, or not at all, is caught."""
    code = tmp_path / "consumer.py"
    code.write_text(
        "def use(cfg):\n"
        "    a = cfg.algo\n"
        "    for name, spec in (('tis', a.tis), ('mis', a.mis)):\n"
        "        print(spec.enabled)\n"
        "    print(cfg.logging.health.window)\n"
        "    shape(cfg.algo.soft_overlong)\n"
        "def shape(so):\n"
        "    return so.factor\n"
    )
    reads = collect_reads([code])
    missing = set(unread_fields(reads))
    assert "algo.tis.enabled" not in missing and "algo.mis.enabled" not in missing  # through the loop
    assert "logging.health.window" not in missing
    assert "algo.soft_overlong.factor" not in missing  # through the call's argument
    assert "algo.tis.auto.window" in missing  # `window` read on health only
    assert "algo.soft_overlong.enabled" in missing  # `enabled` read on tis/mis only
    assert "data.heldout_fraction" in missing
