"""mergekit recipes as input: ``dghard merge --config mergekit.yml --out OUT``.

:func:`translate` is a pure function from a mergekit 0.1.5 configuration (the dict
``yaml.safe_load`` gives for a ``mergekit-yaml`` file) to a dghard recipe dict (the format of
:mod:`dghard_cli.methods.recipe`), with the same numbers: every mergekit default is filled in
explicitly (``density`` 1, ``lambda`` 1, ``normalize`` per method, ...), so a recipe means what
it meant under mergekit. What dghard does not do is a one-line :class:`InputError` naming the
key: layer slices and passthrough (frankenmerges), MoE configurations, tokenizer surgery and
chat templates, LoRA model references, methods dghard does not have, and parameter gradients
(lists) or filters.

Method mapping (mergekit → dghard):

==================  ===========================================================================
``linear``          ``wise-ft`` (α = w_ft / Σw) for BASE + one model, else ``task-arithmetic``
                    with weights w_i / Σw (BASE: ``base_model``, or the first model)
``task_arithmetic`` ``task-arithmetic`` (``normalize: true`` divides λ by Σw)
``ties``            ``ties`` (``normalize`` → disjoint mean / sum)
``dare_ties``       ``dare-ties`` (mergekit's default ``normalize: false``: the disjoint sum)
``dare_linear``     ``dare-linear``
``breadcrumbs``     ``breadcrumbs``;  ``breadcrumbs_ties`` → ``breadcrumbs-ties``
``della``           ``della``;  ``della_linear`` → ``della-linear``
``slerp``           ``slerp`` (``t``)
``model_stock``     ``model-stock`` (``filter_wise``)
==================  ===========================================================================

Model references are resolved as mergekit resolves them (a local path relative to the
current directory, else a Hub id; ``name@revision`` picks a revision).
"""

from __future__ import annotations

import math

from dghard_cli.errors import InputError

#: mergekit method -> (dghard method, mergekit's default normalize, rescale default).
GTA: dict[str, tuple[str, bool, bool]] = {
    "task_arithmetic": ("task-arithmetic", False, False),
    "ties": ("ties", True, False),
    "dare_ties": ("dare-ties", False, True),
    "dare_linear": ("dare-linear", False, True),
    "breadcrumbs": ("breadcrumbs", False, False),
    "breadcrumbs_ties": ("breadcrumbs-ties", False, False),
    "della": ("della", True, True),
    "della_linear": ("della-linear", False, True),
}
#: The sign-electing ones: ``normalize`` chooses the disjoint mean or sum (else it divides by Σw).
CONSENSUS = {"ties", "dare_ties", "breadcrumbs_ties", "della"}
OTHER_METHODS = ("linear", "slerp", "model_stock")
SUPPORTED = (*OTHER_METHODS[:1], *GTA, *OTHER_METHODS[1:])
NOT_HERE = {
    "passthrough": "passthrough stacks layers (a frankenmerge); dghard merges whole models of one architecture",
    "nuslerp": "nuslerp is not in dghard; slerp is",
    "multislerp": "multislerp is not in dghard; slerp (two models) is",
}

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
            f"{where}: {value!r} applies a LoRA adapter (model+lora); dghard merges full checkpoints "
            "(merge the adapter into its base first)"
        )
    if value.count("@") > 1:
        raise InputError(f"{where}: {value!r} has more than one '@' (use name@revision)")
    path, _, rev = value.partition("@")
    out = {"model": path}
    if rev:
        out["revision"] = rev
    return out


def _scalar(value: object, key: str, where: str) -> object:
    if isinstance(value, (list, dict)):
        raise InputError(
            f"{where}: '{key}' is a gradient or a filtered list ({value!r}); dghard takes one value per "
            "parameter for the whole model"
        )
    if value is None:
        raise InputError(f"{where}: '{key}' has no value")
    return value


def _number(value: object, key: str, where: str) -> float:
    v = _scalar(value, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InputError(f"{where}: '{key}' must be a number, got {v!r}")
    return float(v)


def _bool(value: object, key: str, where: str) -> bool:
    v = _scalar(value, key, where)
    if not isinstance(v, bool):
        raise InputError(f"{where}: '{key}' must be true or false, got {v!r}")
    return v


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
    if "slices" in doc:
        raise InputError(
            f"{where}: 'slices' assembles a model from layer ranges (a frankenmerge); dghard merges whole "
            "models: list them under 'models'"
        )
    if "modules" in doc:
        raise InputError(
            f"{where}: 'modules' (per-module slices) is not supported; list whole models under 'models'"
        )
    for key in ("tokenizer_source", "tokenizer"):
        if doc.get(key) is not None:
            raise InputError(
                f"{where}: '{key}' asks for tokenizer surgery; dghard does none (the output keeps the first "
                f"fine-tune's tokenizer files): remove '{key}'"
            )
    if doc.get("chat_template") is not None:
        raise InputError(
            f"{where}: 'chat_template' is not supported (the output keeps the first fine-tune's tokenizer "
            "files and template): remove it"
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


def _models(doc: dict, where: str) -> list[tuple[dict, dict, str]]:
    """``(reference, parameters, where)`` per entry of ``models``."""
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        raise InputError(f"{where}: 'models' must be a non-empty list of models to merge")
    out = []
    for i, entry in enumerate(models):
        w = f"{where}: models[{i}]"
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or "model" not in entry:
            raise InputError(f"{w}: must be a mapping with 'model' (and optional 'parameters')")
        extra = [k for k in entry if k not in ("model", "parameters")]
        if extra:
            raise InputError(f"{w}: unknown key {extra[0]!r} (a model takes 'model' and 'parameters')")
        params = _params(entry.get("parameters"), f"{w}.parameters")
        out.append((_ref(entry["model"], f"{w}.model"), params, w))
    return out


def _same(ref: dict, other: dict) -> bool:
    return ref["model"] == other["model"] and ref.get("revision") == other.get("revision")


def _resolve(
    key: str, models: list[tuple[dict, dict, str]], top: dict, default: object, where: str
) -> list[object]:
    """A per-model parameter's value for each model (its own, else the top-level one, else the default)."""
    out = []
    for _, params, w in models:
        if key in params:
            out.append(_scalar(params[key], key, f"{w}.parameters"))
        elif key in top:
            out.append(_scalar(top[key], key, f"{where}: parameters"))
        else:
            out.append(default)
    return out


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


def translate(doc: dict, where: str) -> dict:
    """The dghard recipe (method, base, models, parameters, dtype) meaning what ``doc`` means in
    mergekit 0.1.5; InputError (one line, naming the key) for what dghard does not do."""
    _refuse_structure(doc, where)
    method = doc.get("merge_method")
    if not isinstance(method, str):
        raise InputError(f"{where}: 'merge_method' must be the name of a mergekit merge method")
    if method in NOT_HERE:
        raise InputError(f"{where}: merge_method {method}: {NOT_HERE[method]}")
    if method not in SUPPORTED:
        raise InputError(
            f"{where}: merge_method {method!r} is not one dghard runs (it runs: {', '.join(SUPPORTED)})"
        )
    top = _params(doc.get("parameters"), f"{where}: parameters")
    models = _models(doc, where)
    base = _ref(doc["base_model"], f"{where}: base_model") if doc.get("base_model") is not None else None
    out: dict = {}
    dtype = _dtype(doc, where)
    if dtype is not None:
        out["dtype"] = dtype
    if method == "linear":
        out.update(_linear(models, base, top, where))
        return out
    if base is None:
        raise InputError(
            f"{where}: merge_method {method} needs 'base_model' (the model the others were fine-tuned from)"
        )
    fts = [m for m in models if not _same(m[0], base)]
    out["base"] = base
    if method == "slerp":
        _check_keys(top, {"t"}, method, f"{where}: parameters")
        for _, params, w in fts:
            _check_keys(params, set(), method, f"{w}.parameters")
        if len(fts) != 1:
            raise InputError(
                f"{where}: merge_method slerp interpolates base_model and one other model; got {len(fts)}"
            )
        if "t" not in top:
            raise InputError(
                f"{where}: parameters: merge_method slerp needs 't' (0 = base_model, 1 = the other)"
            )
        out.update(method="slerp", models=[fts[0][0]], t=_number(top["t"], "t", f"{where}: parameters"))
        return out
    if method == "model_stock":
        _check_keys(top, {"filter_wise"}, method, f"{where}: parameters")
        for _, params, w in fts:
            _check_keys(params, set(), method, f"{w}.parameters")
        if len(fts) < 2:
            raise InputError(
                f"{where}: merge_method model_stock needs at least 2 models besides base_model; got {len(fts)}"
            )
        out.update(method="model-stock", models=[m[0] for m in fts])
        out["filter_wise"] = _bool(top.get("filter_wise", False), "filter_wise", f"{where}: parameters")
        return out
    out.update(_task_vectors(method, fts, top, where))
    return out


def _task_vectors(method: str, fts: list[tuple[dict, dict, str]], top: dict, where: str) -> dict:
    """The generalized task arithmetic family (task_arithmetic, ties, dare_*, breadcrumbs*, della*)."""
    target, normalize_default, rescale_default = GTA[method]
    per_model = {"weight", "density"}
    if method.startswith("breadcrumbs"):
        per_model.add("gamma")
    if method.startswith("della"):
        per_model.add("epsilon")
    shared = {"int8_mask", "normalize", "rescale", "lambda"}
    _check_keys(top, per_model | shared, method, f"{where}: parameters")
    for _, params, w in fts:
        _check_keys(params, per_model, method, f"{w}.parameters")
    if not fts:
        raise InputError(
            f"{where}: every model is base_model; list the fine-tuned models to merge under 'models'"
        )
    tw = f"{where}: parameters"
    weights = [_number(v, "weight", tw) for v in _resolve("weight", fts, top, 1.0, where)]
    lam = _number(top.get("lambda", 1.0), "lambda", tw)
    normalize = _bool(top.get("normalize", normalize_default), "normalize", tw)
    rescale = _bool(top.get("rescale", rescale_default), "rescale", tw)
    _bool(
        top.get("int8_mask", False), "int8_mask", tw
    )  # the mask's dtype in mergekit: no effect on the result
    if rescale != rescale_default:
        what = (
            "dghard's DARE/DELLA always rescale the survivors by 1/keep probability"
            if rescale_default
            else "dghard does not rescale magnitude-pruned deltas"
        )
        raise InputError(
            f"{tw}: 'rescale: {str(rescale).lower()}' for merge_method {method} is not supported ({what})"
        )
    out: dict = {"method": target, "models": []}
    for (ref, _, _), w in zip(fts, weights, strict=True):
        out["models"].append({**ref, "weight": w})
    if method != "task_arithmetic":
        values = [_number(v, "density", tw) for v in _resolve("density", fts, top, 1.0, where)]
        out["density"] = _one("density", values, fts)
    if "gamma" in per_model:
        values = [_number(v, "gamma", tw) for v in _resolve("gamma", fts, top, 0.01, where)]
        out["gamma"] = _one("gamma", values, fts)
    if "epsilon" in per_model:
        values = [_number(v, "epsilon", tw) for v in _resolve("epsilon", fts, top, 0.15, where)]
        out["epsilon"] = _one("epsilon", values, fts)
    if method in CONSENSUS:
        out["normalize"] = normalize
    elif normalize:  # mergekit divides the weighted sum by Σ w_i (unless |Σ w_i| < 1e-8)
        total = sum(weights)
        if abs(total) >= 1e-8:
            lam /= total
    out["lambda"] = lam
    return out


def _linear(models: list[tuple[dict, dict, str]], base: dict | None, top: dict, where: str) -> dict:
    """mergekit ``linear``: Σ w_m·W_m / Σ w_m over every listed model (BASE included when listed)."""
    tw = f"{where}: parameters"
    _check_keys(top, {"weight", "normalize"}, "linear", tw)
    for _, params, w in models:
        _check_keys(params, {"weight"}, "linear", f"{w}.parameters")
    inputs = list(models)
    if base is not None and not any(_same(m[0], base) for m in inputs):
        if "weight" not in top:
            raise InputError(
                f"{where}: merge_method linear averages base_model too, but it has no weight: list it under "
                "'models' with parameters.weight"
            )
        inputs.append((base, {}, f"{where}: base_model"))
    if len(inputs) < 2:
        raise InputError(
            f"{where}: merge_method linear needs at least 2 models to average; got {len(inputs)}"
        )
    weights = []
    for (_, _, w), v in zip(inputs, _resolve("weight", inputs, top, None, where), strict=True):
        if v is None:
            raise InputError(f"{w}: merge_method linear needs a weight for every model (parameters.weight)")
        weights.append(_number(v, "weight", f"{w}.parameters"))
    normalize = _bool(top.get("normalize", True), "normalize", tw)
    total = sum(weights)
    if normalize:
        if abs(total) < 1e-12:
            raise InputError(
                f"{where}: merge_method linear: the weights sum to 0, so the average is undefined"
            )
        coef = [w / total for w in weights]
    else:
        if abs(total - 1.0) > 1e-9:
            raise InputError(
                f"{where}: merge_method linear with normalize: false and weights summing to {total:g} scales the "
                "whole model; dghard merges task vectors (weights summing to 1)"
            )
        coef = weights
    b = next((i for i, m in enumerate(inputs) if base is not None and _same(m[0], base)), 0)
    others = [(m[0], c) for i, (m, c) in enumerate(zip(inputs, coef, strict=True)) if i != b]
    out: dict = {"base": inputs[b][0]}
    if len(others) == 1 and 0.0 <= others[0][1] <= 1.0:
        out.update(method="wise-ft", models=[others[0][0]], alpha=others[0][1])
    else:
        out.update(
            method="task-arithmetic", models=[{**ref, "weight": c} for ref, c in others], **{"lambda": 1.0}
        )
    return out
