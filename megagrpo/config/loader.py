"""Load a `Config` from YAML plus dotted command-line overrides; turn every failure into a `MegagrpoError`.

Error messages name the dotted field path, the bad value and what is allowed, e.g.
``algo.variant: 'ppo' is not one of grpo, gspo, ...``; unknown keys get difflib suggestions. The CLI
prints the message without a traceback.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from megagrpo.config.schema import Config
from megagrpo.errors import MegagrpoError

# --------------------------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float (YAML 1.1 needs `1.0e-6`) and rejects duplicate keys."""


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in "-+0123456789.":
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx)
        for tag, rx in _Loader.yaml_implicit_resolvers.get(_ch, [])
        if tag != "tag:yaml.org,2002:float"
    ]
    _Loader.yaml_implicit_resolvers[_ch].insert(0, ("tag:yaml.org,2002:float", _FLOAT))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise MegagrpoError(
                f"{key_node.start_mark.name}:{key_node.start_mark.line + 1}: duplicate key {key!r} (first at "
                f"line {seen[key]}); remove one of them"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with megagrpo's loader; syntax errors become MegagrpoError with file:line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise MegagrpoError(f"{where}: invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise MegagrpoError(f"{source}: invalid YAML: {e}") from None


# ---------------------------------------------------------------------------------------- overrides


def apply_override(tree: dict, override: str) -> None:
    """Apply one `dotted.key=value` (value parsed as a YAML scalar/flow value) to a nested dict in place."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise MegagrpoError(f"override {override!r}: expected dotted.key=value, e.g. algo.clip_high=0.28")
    if raw.strip() == "":
        raise MegagrpoError(f"override {override!r}: empty value; write {key}=null to set null")
    value = parse_yaml(raw, source=f"override {key}")
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        node = _child(node, part, ".".join(parts[: i + 1]), create=True)
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise MegagrpoError(f"override {key}: {'.'.join(parts[:-1])} is {node!r}, not a section")


def _index(node: list, part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise MegagrpoError(f"override {path}: {part!r} is not an index of a list of {len(node)} items")
    return int(part)


def _child(node: Any, part: str, path: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise MegagrpoError(f"override {path}: the parent is {node!r}, not a section")
    if node.get(part) is None and create:
        node[part] = {}
    return node[part]


# ----------------------------------------------------------------------------------------- messages


def _unwrap(ann: Any) -> list[Any]:
    """Members of a Union/Optional annotation (or the annotation itself)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(ann) for m in _unwrap(a)]
    return [ann]


def describe_type(ann: Any) -> str:
    """Human description of an annotation: 'one of a, b', 'a number', 'a list of strings', ..."""
    parts = []
    for m in _unwrap(ann):
        origin = typing.get_origin(m)
        if origin is Literal:
            args = typing.get_args(m)
            parts.append(repr(args[0]) if len(args) == 1 else "one of " + ", ".join(str(a) for a in args))
        elif m is type(None):
            parts.append("null")
        elif m is bool:
            parts.append("true or false")
        elif m is int:
            parts.append("an integer")
        elif m is float:
            parts.append("a number")
        elif m is str:
            parts.append("a string")
        elif origin is list:
            (item,) = typing.get_args(m) or (Any,)
            parts.append(f"a list of ({describe_type(item)})")
        elif origin is dict or m is dict:
            parts.append("a mapping")
        elif isinstance(m, type) and issubclass(m, BaseModel):
            parts.append("a section (mapping)")
        else:
            parts.append(str(m))
    return " or ".join(parts)


def _resolve(loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Walk a pydantic error location through the schema.

    Returns (path parts, the model that owns the last field, that field's annotation); union-member tags
    that pydantic appends to the location are dropped.
    """
    model: Any = Config
    owner, ann = None, None
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if isinstance(model, type) and issubclass(model, BaseModel) and item in model.model_fields:
            owner, ann = model, model.model_fields[item].annotation
            parts.append(item)
            model = _section_of(ann)
        elif isinstance(model, type) and issubclass(model, BaseModel) and owner is not model:
            parts.append(str(item))  # an unknown key: keep it so the message names it
            owner, ann, model = model, None, None
        # else: a union-member tag such as 'float' or "literal['auto']"
    return parts, owner, ann


def _section_of(ann: Any) -> Any:
    for m in _unwrap(ann):
        if typing.get_origin(m) is list:
            (m,) = typing.get_args(m)
        if isinstance(m, type) and issubclass(m, BaseModel):
            return m
    return None


def _required_leaves(path: str, owner: Any, ann: Any) -> list[tuple[str, Any, str]]:
    """A missing section is reported as its missing required fields (`model` -> `model.hf_path`)."""
    section = _section_of(ann)
    if section is None:
        desc = owner.model_fields[path.rsplit(".", 1)[-1].split("[")[0]].description if owner else ""
        return [(path, ann, desc or "")]
    out = []
    for name, f in section.model_fields.items():
        if f.is_required():
            out += _required_leaves(f"{path}.{name}", section, f.annotation)
    return out


def _fmt_value(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per bad field: 'path: bad value ... expected ...'; several union branches merge into one."""
    lines: dict[str, str] = {}
    for e in err.errors():
        parts, owner, ann = _resolve(e["loc"])
        ctx = e.get("ctx") or {}
        if e["type"] == "megagrpo_invalid":
            path = ".".join(parts + [ctx["field"]])
            lines.setdefault(path, f"{path}: {ctx['message']}")
            continue
        path = ".".join(parts) or "<root>"
        if path in lines:
            continue
        if e["type"] == "extra_forbidden":
            key = parts[-1].split("[")[0]
            allowed = list(owner.model_fields) if owner else []
            close = difflib.get_close_matches(key, allowed, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            lines[path] = f"{path}: unknown key{hint} (allowed here: {', '.join(allowed)})"
        elif e["type"] == "missing":
            for sub, sub_ann, desc in _required_leaves(path, owner, ann):
                lines[sub] = f"{sub}: required but missing ({describe_type(sub_ann)}): {desc}"
        elif ann is not None and e["type"] in _TYPE_ERRORS:
            lines[path] = f"{path}: {_fmt_value(e['input'])} is not {describe_type(ann)}"
        else:
            lines[path] = f"{path}: {_fmt_value(e['input'])} is invalid: {e['msg'][0].lower()}{e['msg'][1:]}"
    body = "\n  ".join(lines.values())
    return f"invalid config {source}:\n  {body}"


_TYPE_ERRORS = {
    "literal_error",
    "int_type",
    "int_parsing",
    "int_from_float",
    "float_type",
    "float_parsing",
    "bool_type",
    "bool_parsing",
    "string_type",
    "list_type",
    "dict_type",
    "model_type",
    "model_attributes_type",
}


# ------------------------------------------------------------------------------------------- public


def config_from_dict(tree: Any, source: str = "<dict>") -> Config:
    """Validate a nested dict (already merged with overrides) into a `Config`."""
    if not isinstance(tree, dict):
        raise MegagrpoError(f"{source}: the config must be a mapping of sections, got {type(tree).__name__}")
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise MegagrpoError(format_validation_error(e, source)) from None


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    check_paths: bool = True,
    stage: str = "train",
) -> Config:
    """Read YAML at `path` (None: start from an empty mapping), apply `key=value` overrides, validate.

    With `check_paths`, the files the `stage` ('train', 'sft' or 'eval') reads must exist (see
    `check_config_paths`).
    """
    tree: Any = {}
    source = "<overrides>"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise MegagrpoError(f"config file {str(p)!r} does not exist; pass the path of a YAML config")
        tree = parse_yaml(p.read_text(), source=str(p))
        source = str(p)
        if tree is None:
            tree = {}
    if not isinstance(tree, dict):
        raise MegagrpoError(f"{source}: the config must be a mapping of sections, got {type(tree).__name__}")
    for ov in overrides or []:
        apply_override(tree, ov)
    cfg = config_from_dict(tree, source)
    if check_paths:
        check_config_paths(cfg, stage)
    return cfg


def check_config_paths(cfg: Config, stage: str = "train") -> None:
    """The files a stage reads must exist before any process group or engine starts.

    'train'/'eval' read model.hf_path; 'sft' reads sft.base_path (or model.hf_path when null), and its
    output becomes model.hf_path later, so that path need not exist yet.
    """
    if stage not in ("train", "sft", "eval"):
        raise ValueError(f"stage must be train, sft or eval, got {stage!r}")
    field, value = "model.hf_path", cfg.model.hf_path
    if stage == "sft" and cfg.sft.base_path is not None:
        field, value = "sft.base_path", cfg.sft.base_path
    model = Path(value)
    if not model.is_dir():
        raise MegagrpoError(
            f"{field}: {value!r} does not exist or is not a directory; point it at a "
            "Hugging Face model directory (e.g. one written by tools/make_tiny_model.py)"
        )
    if not (model / "config.json").is_file():
        raise MegagrpoError(
            f"{field}: {value!r} has no config.json; it is not a Hugging Face model directory"
        )
    if cfg.model.tokenizer_path is not None and not Path(cfg.model.tokenizer_path).is_dir():
        raise MegagrpoError(f"model.tokenizer_path: {cfg.model.tokenizer_path!r} does not exist")
    sections = [("data", cfg.data)]
    if stage == "sft" and cfg.sft.data is not None:
        sections = [("sft.data", cfg.sft.data)]
    for prefix, data in sections:
        for name in ("train_path", "eval_path"):
            value = getattr(data, name)
            if value is not None and not Path(value).is_file():
                raise MegagrpoError(
                    f"{prefix}.{name}: {value!r} does not exist; give a local .jsonl or .parquet file"
                )


def dump_config(cfg: Config) -> str:
    """The fully-resolved config as YAML (saved beside checkpoints and metrics for reproducibility)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
