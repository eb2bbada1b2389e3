"""Reading a mergekit 0.1.5 configuration: its structure (what dghard refuses: MoE, slices that
assemble layer ranges, tokenizer surgery), model references (``path@revision``), the output
dtype, the parameter scopes (a model's own, the slice's, the top level) and how mergekit
evaluates a setting for one tensor (gradients over the layers, ``filter``/``value`` entries).

Relies only on :class:`~dghard_cli.errors.InputError`; the per-method mapping is in
:mod:`dghard_cli.recipes.mergekit_mapping`, and :mod:`dghard_cli.recipes.mergekit`
(``translate``) is the public entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dghard_cli.errors import InputError

TOP_KEYS = {
    "merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "slices", "modules",
    "tokenizer_source", "tokenizer", "chat_template",
}  # fmt: skip
MOE_KEYS = ("experts", "gate_mode", "experts_per_token", "shared_experts")


def is_mergekit(doc: object) -> bool:
    """A mergekit configuration (``merge_method``) or a mergekit-moe one (``experts``)."""
    return isinstance(doc, dict) and ("merge_method" in doc or any(k in doc for k in MOE_KEYS))


def _ref(value: object, where: str) -> dict:
    """A model reference: ``path`` or ``path@revision``; LoRA (``model+lora``) is refused."""
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: must be a model path or Hub id (a string), got {value!r}")
    if "+" in value:
        raise InputError(
            f"{where}: {value!r}: a LoRA reference (model+lora) is a fine-tune under 'models' whose "
            "model is base_model"
        )
    if value.count("@") > 1:
        raise InputError(f"{where}: {value!r} has more than one '@' (use name@revision)")
    path, _, rev = value.partition("@")
    out = {"model": path}
    if rev:
        out["revision"] = rev
    return out


def lora_references(doc: dict, where: str) -> dict:
    """The recipe with each ``model+adapter`` reference replaced by the adapter (dghard reads a
    PEFT LoRA adapter as the fine-tune it makes of its base), after checking that the model
    before ``+`` is ``base_model``: an adapter applies to the model it was trained on."""
    base = doc.get("base_model")
    base_name = base if isinstance(base, str) else None

    def swap(value: object, w: str) -> object:
        if not isinstance(value, str) or "+" not in value:
            return value
        model, _, adapter = value.partition("+")
        if not model or not adapter or "+" in adapter:
            raise InputError(f"{w}: {value!r} is not of the form path/to/model+path/to/adapter")
        if base_name is None or model != base_name.partition("@")[0]:
            raise InputError(
                f"{w}: {value!r} applies a LoRA adapter to {model!r}, which is not base_model "
                f"({base_name!r}); dghard merges fine-tunes of base_model"
            )
        return adapter

    def entries(items: object, w: str) -> object:
        if not isinstance(items, list):
            return items
        out = []
        for i, e in enumerate(items):
            if isinstance(e, dict) and "model" in e:
                e = {**e, "model": swap(e["model"], f"{w}[{i}].model")}
            else:
                e = swap(e, f"{w}[{i}]")
            out.append(e)
        return out

    doc = dict(doc)
    if "models" in doc:
        doc["models"] = entries(doc["models"], f"{where}: models")
    if isinstance(doc.get("slices"), list):
        doc["slices"] = [
            {**sl, "sources": entries(sl.get("sources"), f"{where}: slices[{j}].sources")}
            if isinstance(sl, dict)
            else sl
            for j, sl in enumerate(doc["slices"])
        ]
    return doc


@dataclass(frozen=True)
class Where:
    """Which tensor the parameters are evaluated for: its name and its layer fraction
    ``t = layer / (layers − 1)`` (0 for tensors outside the layers), as mergekit evaluates
    gradients and filters. The default (no name, t = 0) is what the recipe says outside any
    filter: the values checked when the recipe is read."""

    tensor: str = ""
    t: float = 0.0


def _setting(value: object, key: str, where: str, at: Where) -> object:
    """mergekit's ``evaluate_setting``: a scalar; a list of numbers (a gradient over the layers,
    interpolated at ``at.t``); or ``filter``/``value`` entries (the first whose filter is in the
    tensor's name, or has none, or is ``*``). None: no entry applies."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, list):
        raise InputError(
            f"{where}: '{key}' must be a value, a list (gradient) or filter/value entries, got {value!r}"
        )
    if not value:
        return None
    if all(isinstance(v, (bool, int, float, str)) for v in value):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return value[int(at.t * (len(value) - 1))]
        scaled = at.t * (len(value) - 1)
        i0 = int(scaled)
        i1 = min(len(value) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * value[i0] + frac * value[i1]
    for cond in value:
        if (
            not isinstance(cond, dict)
            or "value" not in cond
            or any(k not in ("filter", "value") for k in cond)
        ):
            raise InputError(
                f"{where}: '{key}': each entry of a filtered list is {{filter: ..., value: ...}}, got {cond!r}"
            )
        f = cond.get("filter")
        if f is None or f == "*" or (at.tensor and isinstance(f, str) and f in at.tensor):
            return _setting(cond["value"], key, where, at)
    return None


def varies(doc: dict) -> bool:
    """Does a parameter of this mergekit recipe vary by layer or tensor (gradients, filters)?"""
    scopes = [doc.get("parameters")]
    for entry in doc.get("models") or []:
        if isinstance(entry, dict):
            scopes.append(entry.get("parameters"))
    for sl in doc.get("slices") or []:
        if isinstance(sl, dict):
            scopes.append(sl.get("parameters"))
            scopes += [src.get("parameters") for src in sl.get("sources") or [] if isinstance(src, dict)]
    return any(isinstance(v, (list, dict)) for sc in scopes if isinstance(sc, dict) for v in sc.values())


def _number(value: object, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: '{key}' must be a number, got {value!r}")
    return float(value)


def _bool(value: object, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def _params(raw: object, where: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(f"{where}: must be a mapping of parameter names to values, got {raw!r}")
    return raw


def _refuse_structure(doc: dict, where: str) -> None:
    moe = [k for k in doc if k in MOE_KEYS]
    if moe:
        raise InputError(
            f"{where}: '{moe[0]}' is a mergekit-moe (mixture of experts) key; dghard does not build MoE models"
        )
    for key in doc:
        if key not in TOP_KEYS:
            raise InputError(f"{where}: unknown mergekit key {key!r} (known: {', '.join(sorted(TOP_KEYS))})")
    if "slices" in doc and "models" in doc:
        raise InputError(f"{where}: give either 'models' or 'slices', not both")
    if "modules" in doc:
        raise InputError(
            f"{where}: 'modules' (per-module slices) is not supported; list whole models under 'models'"
        )
    tokenizer_source(doc, where)
    if doc.get("chat_template") is not None:
        raise InputError(
            f"{where}: 'chat_template' is not supported (the output keeps the first fine-tune's tokenizer "
            "files and template): remove it"
        )


def tokenizer_source(doc: dict, where: str) -> str | None:
    """``base`` when the recipe asks for the base model's tokenizer (``tokenizer_source: base``,
    the base model's own name, or ``tokenizer: {source: base}``): a no-op when every model shares
    the base's vocabulary, which the merge checks. Anything else is tokenizer surgery: refused."""
    value, key = doc.get("tokenizer_source"), "tokenizer_source"
    if doc.get("tokenizer") is not None:
        tok, key = doc["tokenizer"], "tokenizer"
        if value is not None or not isinstance(tok, dict) or set(tok) != {"source"}:
            value = tok if value is None else value
        else:
            value = tok["source"]
    if value is None:
        return None
    if value == "base" or (isinstance(value, str) and value == doc.get("base_model")):
        return "base"
    raise InputError(
        f"{where}: '{key}: {value}' asks for tokenizer surgery; dghard does none: it takes "
        "'tokenizer_source: base' (or the base model's own name) when every model shares the base's "
        f"vocabulary; remove '{key}'"
    )


def _dtype(doc: dict, where: str) -> str | None:
    """dghard's output dtype: mergekit's ``out_dtype``, else its ``dtype`` (the merge's dtype)."""
    key = "out_dtype" if doc.get("out_dtype") is not None else "dtype"
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: '{key}' must be a dtype name such as bfloat16, got {value!r}")
    name = value.removeprefix("torch.")
    if name not in ("bfloat16", "float16", "float32", "float64"):
        raise InputError(f"{where}: '{key}: {value}' is not one of bfloat16, float16, float32, float64")
    return name


Model = tuple[dict, dict, str]  # (reference, its parameters, where in the recipe)
Scope = tuple[dict, str]  # (parameters, where in the recipe)


def _model_entry(entry: object, w: str, keys: tuple[str, ...]) -> Model:
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict) or "model" not in entry:
        raise InputError(f"{w}: must be a mapping with 'model' (and optional 'parameters')")
    extra = [k for k in entry if k not in keys]
    if extra:
        raise InputError(f"{w}: unknown key {extra[0]!r} (a model takes {', '.join(keys)})")
    return _ref(entry["model"], f"{w}.model"), _params(entry.get("parameters"), f"{w}.parameters"), w


def _models(doc: dict, where: str) -> tuple[list[Model], list[Scope], int | None]:
    """The models, the merge-wide parameter scopes (highest precedence first), and — for a
    ``slices`` recipe — how many layers its one slice takes (it must be the whole model)."""
    top = [(_params(doc.get("parameters"), f"{where}: parameters"), f"{where}: parameters")]
    if "slices" not in doc:
        models = doc.get("models")
        if not isinstance(models, list) or not models:
            raise InputError(f"{where}: 'models' must be a non-empty list of models to merge")
        return (
            [_model_entry(e, f"{where}: models[{i}]", ("model", "parameters")) for i, e in enumerate(models)],
            top,
            None,
        )
    slices = doc["slices"]
    if not isinstance(slices, list) or len(slices) != 1:
        n = len(slices) if isinstance(slices, list) else 0
        raise InputError(
            f"{where}: 'slices' has {n} slices: assembling a model from layer ranges (a frankenmerge) is not "
            "supported; dghard merges whole models (one slice over every layer, or 'models')"
        )
    sl, w = slices[0], f"{where}: slices[0]"
    if not isinstance(sl, dict) or not isinstance(sl.get("sources"), list) or not sl["sources"]:
        raise InputError(f"{w}: must be a mapping with a non-empty 'sources' list")
    extra = [k for k in sl if k not in ("sources", "parameters")]
    if extra:
        raise InputError(
            f"{w}: '{extra[0]}' is not supported in a slice (dghard takes 'sources' and 'parameters')"
        )
    models, ranges = [], []
    for i, src in enumerate(sl["sources"]):
        ws = f"{w}.sources[{i}]"
        models.append(_model_entry(src, ws, ("model", "layer_range", "parameters")))
        lr = src.get("layer_range") if isinstance(src, dict) else None
        if not (
            isinstance(lr, list)
            and len(lr) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in lr)
        ):
            raise InputError(f"{ws}: 'layer_range' must be [first, end] (integers), got {lr!r}")
        ranges.append(tuple(lr))
    if any(r != ranges[0] for r in ranges) or ranges[0][0] != 0 or ranges[0][1] <= 0:
        raise InputError(
            f"{w}: layer ranges {[list(r) for r in ranges]} take parts of models (a frankenmerge); dghard "
            "merges whole models: every source over [0, number of layers]"
        )
    scopes = [(_params(sl.get("parameters"), f"{w}.parameters"), f"{w}.parameters"), *top]
    return models, scopes, ranges[0][1]


def slice_layers(doc: dict, where: str) -> int | None:
    """For a ``slices`` recipe, the layer count its one slice covers (checked against the models)."""
    return _models(doc, where)[2] if "slices" in doc else None


def _same(ref: dict, other: dict) -> bool:
    return ref["model"] == other["model"] and ref.get("revision") == other.get("revision")


def _get(key: str, scopes: list[Scope], default: object, at: Where) -> object:
    """A parameter from the first scope that sets it (and whose filters apply), else ``default``."""
    for params, w in scopes:
        if key in params:
            v = _setting(params[key], key, w, at)
            if v is not None:
                return v
    return default


def _resolve(key: str, models: list[Model], scopes: list[Scope], default: object, at: Where) -> list[object]:
    """A per-model parameter for each model: its own, else the slice's/top-level one, else ``default``."""
    return [_get(key, [(params, f"{w}.parameters"), *scopes], default, at) for _, params, w in models]


def _one(key: str, values: list[object], models: list[tuple[dict, dict, str]]) -> object:
    """The one value dghard takes for all fine-tunes, or an error naming the model that differs."""
    for v, (_, _, w) in zip(values[1:], models[1:], strict=True):
        if v != values[0]:
            raise InputError(
                f"{w}.parameters: '{key}' {v!r} differs from the first model's {values[0]!r}; dghard takes "
                f"one {key} for all fine-tunes"
            )
    return values[0]


def _check_keys(params: dict, allowed: set[str], method: str, where: str) -> None:
    for key in params:
        if key not in allowed:
            raise InputError(
                f"{where}: '{key}' is not a parameter of merge_method {method} "
                f"(it takes: {', '.join(sorted(allowed))})"
            )


def _check_all(
    models: list[Model], scopes: list[Scope], per_model: set[str], shared: set[str], method: str
) -> None:
    for params, w in scopes:
        _check_keys(params, per_model | shared, method, w)
    for _, params, w in models:
        _check_keys(params, per_model, method, f"{w}.parameters")
