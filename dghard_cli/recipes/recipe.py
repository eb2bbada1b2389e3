"""YAML merge recipes: ``dghard merge --config recipe.yaml``.

A recipe holds the same things as the command line (see the README for the format)::

    method: ties
    base: ../examples/tiny/base
    models:
      - model: ../examples/tiny/ft
        weight: 1.0
      - ../examples/tiny/ft2          # weight 1
    density: 0.2
    lambda: 1.0
    out: ../out/ties

A mergekit recipe (a ``merge_method`` key) is translated first by
:func:`dghard_cli.recipes.mergekit.translate`; its relative model paths are resolved
against the current directory, as mergekit resolves them, and OUT comes from ``--out``.

Read with ``yaml.safe_load`` only. Every key is checked (unknown key, wrong type, missing
``method``/``base``/``models``) with a one-line error naming the recipe. Relative paths
(models, ``out``, ``calib``, ``report``) are resolved against the recipe's directory; a model
that is not a path there and looks like ``org/name`` is a Hugging Face Hub id.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import path_exists
from dghard_cli.io.hub import is_hub_id
from dghard_cli.io.yaml_file import read_yaml_file
from dghard_cli.methods import registry
from dghard_cli.recipes.mergekit import TensorParameters, is_mergekit, translate, varies

MAX_RECIPE_BYTES = 1024 * 1024

NUMBER, INT, STR, BOOL, STR_LIST, SIZE = "number", "integer", "string", "boolean", "list of strings", "size"

#: Recipe keys that are not merge parameters: the models and the run's settings.
MODEL_SET_KEYS: dict[str, str] = {"method": STR, "base": "model", "models": "list of models", "out": STR}
POLICY_KEYS: dict[str, str] = {
    "include": STR_LIST,
    "exclude": STR_LIST,
    "min_numel": INT,
    "dtype": STR,
    "shard_size": SIZE,
    "allow_missing": BOOL,
    "device": STR,
    "report": STR,
}
MODEL_KEYS = {"model": STR, "weight": NUMBER, "density": NUMBER, "revision": STR}


def top_keys() -> dict[str, str]:
    """Every top-level key and its kind: the model set, each method parameter (from the
    registry), the run's settings."""
    return {**MODEL_SET_KEYS, **registry.recipe_keys(), **POLICY_KEYS}


@dataclass
class ModelRef:
    spec: str
    weight: float | None = None
    revision: str | None = None
    density: float | None = None  # this fine-tune's density (else the recipe's)


@dataclass
class Recipe:
    path: Path
    method: str
    base: ModelRef
    models: list[ModelRef]
    values: dict = field(default_factory=dict)  # every other top-level key given
    maps: dict = field(default_factory=dict)  # mapping parameters (``recall:``) by name
    mergekit: bool = False  # translated from a mergekit recipe
    tensor_parameters: TensorParameters | None = None  # its gradients/filters/slice, per tensor
    #: ``base``: a mergekit ``tokenizer_source: base`` (checked at merge time: a shared vocabulary)
    tokenizer_source: str | None = None

    @property
    def recall(self) -> dict:
        return self.maps.get("recall", {})

    @property
    def weights(self) -> list[float] | None:
        if all(m.weight is None for m in self.models):
            return None
        return [1.0 if m.weight is None else m.weight for m in self.models]

    @property
    def densities(self) -> list[float | None] | None:
        """One density per fine-tune when a model sets its own (the others: the recipe's, or None)."""
        if all(m.density is None for m in self.models):
            return None
        top = self.values.get("density")
        return [top if m.density is None else m.density for m in self.models]


def _type_ok(value: object, kind: str) -> bool:
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STR_LIST:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == SIZE:
        return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
    return True


def _check_mapping(doc: dict, known: dict[str, str], where: str) -> None:
    for key, value in doc.items():
        if not isinstance(key, str) or key not in known:
            raise InputError(f"{where}: unknown key {key!r} (known keys: {', '.join(known)})")
        if value is None:
            raise InputError(f"{where}: key {key!r} has no value")
        if not _type_ok(value, known[key]):
            raise InputError(
                f"{where}: key {key!r} must be {_article(known[key])} {known[key]}, got {type(value).__name__} {value!r}"
            )


def _resolve_model(spec: str, root: Path) -> str:
    p = Path(spec).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = root / p
    if path_exists(candidate) or not is_hub_id(spec) or spec.startswith("."):
        return os.path.normpath(candidate)
    return spec


def _resolve_path(value: str, root: Path) -> str:
    p = Path(value).expanduser()
    return str(p) if p.is_absolute() else os.path.normpath(root / p)


def _model(entry: object, where: str, root: Path) -> ModelRef:
    if isinstance(entry, str):
        return ModelRef(_resolve_model(entry, root))
    if not isinstance(entry, dict):
        raise InputError(f"{where}: must be a path/Hub id or a mapping with 'model', got {entry!r}")
    _check_mapping(entry, MODEL_KEYS, where)
    if "model" not in entry:
        raise InputError(f"{where}: missing 'model' (the checkpoint directory or Hub id)")
    w, d = entry.get("weight"), entry.get("density")
    return ModelRef(
        _resolve_model(entry["model"], root),
        None if w is None else float(w),
        entry.get("revision"),
        None if d is None else float(d),
    )


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe; InputError (exit 2) with a one-line message otherwise."""

    path = Path(path).expanduser()
    where = f"recipe {path}"
    doc = read_yaml_file(path, where, MAX_RECIPE_BYTES)
    if not isinstance(doc, dict):
        raise InputError(f"{where}: must be a YAML mapping of keys (method, base, models, ...)")
    root = path.parent
    mergekit = is_mergekit(doc)
    per_tensor = None
    tokenizer = None
    if mergekit:
        where = f"mergekit recipe {path}"
        if varies(doc) or "slices" in doc:
            per_tensor = TensorParameters(doc, where)
        doc = translate(doc, where)
        tokenizer = doc.pop("tokenizer_source", None)
        root = Path.cwd()  # mergekit resolves local model paths against the current directory
    _check_mapping(doc, top_keys(), where)
    for key in ("method", "base", "models"):
        if key not in doc:
            raise InputError(f"{where}: missing {key!r}")
    base = _model(doc["base"], f"{where}: base", root)
    if base.weight is not None or base.density is not None:
        key = "weight" if base.weight is not None else "density"
        raise InputError(f"{where}: base: '{key}' applies to the fine-tunes under 'models', not to base")
    models_doc = doc["models"]
    if not isinstance(models_doc, list) or not models_doc:
        raise InputError(f"{where}: 'models' must be a non-empty list of fine-tuned checkpoints")
    models = [_model(e, f"{where}: models[{i}]", root) for i, e in enumerate(models_doc)]
    maps: dict = {}
    for name in registry.mapping_params():
        sub = doc.get(name, {})
        if not isinstance(sub, dict):
            raise InputError(f"{where}: key {name!r} must be a mapping of {registry.params()[name].help}")
        _check_mapping(sub, registry.sub_keys(name), f"{where}: {name}")
        maps[name] = sub
    values = {k: v for k, v in doc.items() if k not in ("method", "base", "models", *maps)}
    for key in ("out", "calib", "report"):
        if key in values:
            values[key] = _resolve_path(values[key], root)
    strengths = values.get("layer_strengths")
    if isinstance(strengths, str) and "=" not in strengths:  # the path of a YAML file of them
        values["layer_strengths"] = _resolve_path(strengths, root)
    for key in ("include", "exclude"):
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
    return Recipe(
        path=path,
        method=doc["method"],
        base=base,
        models=models,
        values=values,
        maps=maps,
        mergekit=mergekit,
        tensor_parameters=per_tensor,
        tokenizer_source=tokenizer,
    )


def _article(kind: str) -> str:
    return "an" if kind[:1] in "aeiou" else "a"
