"""mergekit recipes as input: ``dghard merge --config mergekit.yml --out OUT``.

:func:`translate` is a pure function from a mergekit 0.1.5 configuration (the dict
``yaml.safe_load`` gives for a ``mergekit-yaml`` file) to a dghard recipe dict (the format of
:mod:`dghard_cli.methods.recipe`), with the same numbers: every mergekit default is filled in
explicitly (``density`` 1, ``lambda`` 1, ``normalize`` per method, ...), so a recipe means what
it meant under mergekit. Parameters that vary by layer or tensor — gradients (lists),
``filter``/``value`` entries, one density per model — are evaluated per tensor as mergekit
evaluates them (:class:`TensorParameters`), and a ``slices`` recipe whose one slice takes every
layer of every source is a whole-model merge. What dghard does not do is a one-line
:class:`InputError` naming the key: layer-range assembly and passthrough (frankenmerges), MoE
configurations, tokenizer surgery and chat templates, LoRA model references, methods dghard
does not have.

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
from dataclasses import dataclass

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


def translate(doc: dict, where: str, at: Where | None = None) -> dict:
    """The dghard recipe (method, base, models, parameters, dtype) meaning what ``doc`` means in
    mergekit 0.1.5, with its parameters evaluated for the tensor ``at`` (default: outside any
    filter, layer fraction 0); InputError (one line, naming the key) for what dghard does not do."""
    at = at or Where()
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
    models, scopes, _ = _models(doc, where)
    base = _ref(doc["base_model"], f"{where}: base_model") if doc.get("base_model") is not None else None
    out: dict = {}
    dtype = _dtype(doc, where)
    if dtype is not None:
        out["dtype"] = dtype
    if method == "linear":
        out.update(_linear(models, base, scopes, where, at, always_weights=varies(doc)))
        return out
    if base is None:
        raise InputError(
            f"{where}: merge_method {method} needs 'base_model' (the model the others were fine-tuned from)"
        )
    fts = [m for m in models if not _same(m[0], base)]
    out["base"] = base
    if method == "slerp":
        _check_all(fts, scopes, set(), {"t"}, method)
        if len(fts) != 1:
            raise InputError(
                f"{where}: merge_method slerp interpolates base_model and one other model; got {len(fts)}"
            )
        t = _get("t", scopes, None, at)
        if t is None:
            raise InputError(
                f"{where}: parameters: merge_method slerp needs 't' (0 = base_model, 1 = the other)"
            )
        out.update(method="slerp", models=[fts[0][0]], t=_number(t, "t", scopes[0][1]))
        return out
    if method == "model_stock":
        _check_all(fts, scopes, set(), {"filter_wise"}, method)
        if len(fts) < 2:
            raise InputError(
                f"{where}: merge_method model_stock needs at least 2 models besides base_model; got {len(fts)}"
            )
        out.update(method="model-stock", models=[m[0] for m in fts])
        out["filter_wise"] = _bool(_get("filter_wise", scopes, False, at), "filter_wise", scopes[0][1])
        return out
    out.update(_task_vectors(method, fts, scopes, where, at))
    return out


def _task_vectors(method: str, fts: list[Model], scopes: list[Scope], where: str, at: Where) -> dict:
    """The generalized task arithmetic family (task_arithmetic, ties, dare_*, breadcrumbs*, della*)."""
    target, normalize_default, rescale_default = GTA[method]
    per_model = {"weight", "density"}
    if method.startswith("breadcrumbs"):
        per_model.add("gamma")
    if method.startswith("della"):
        per_model.add("epsilon")
    _check_all(fts, scopes, per_model, {"int8_mask", "normalize", "rescale", "lambda"}, method)
    if not fts:
        raise InputError(
            f"{where}: every model is base_model; list the fine-tuned models to merge under 'models'"
        )
    tw = scopes[0][1]
    weights = [_number(v, "weight", tw) for v in _resolve("weight", fts, scopes, 1.0, at)]
    lam = _number(_get("lambda", scopes, 1.0, at), "lambda", tw)
    normalize = _bool(_get("normalize", scopes, normalize_default, at), "normalize", tw)
    rescale = _bool(_get("rescale", scopes, rescale_default, at), "rescale", tw)
    _bool(
        _get("int8_mask", scopes, False, at), "int8_mask", tw
    )  # mergekit's mask dtype: no effect on the result
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
        values = [_number(v, "density", tw) for v in _resolve("density", fts, scopes, 1.0, at)]
        if all(v == values[0] for v in values):
            out["density"] = values[0]
        else:  # one density per fine-tune
            for m, v in zip(out["models"], values, strict=True):
                m["density"] = v
    if "gamma" in per_model:
        values = [_number(v, "gamma", tw) for v in _resolve("gamma", fts, scopes, 0.01, at)]
        out["gamma"] = _one("gamma", values, fts)
    if "epsilon" in per_model:
        values = [_number(v, "epsilon", tw) for v in _resolve("epsilon", fts, scopes, 0.15, at)]
        out["epsilon"] = _one("epsilon", values, fts)
    if method in CONSENSUS:
        out["normalize"] = normalize
    elif normalize:  # mergekit divides the weighted sum by Σ w_i (unless |Σ w_i| < 1e-8)
        total = sum(weights)
        if abs(total) >= 1e-8:
            lam /= total
    out["lambda"] = lam
    return out


def _linear(
    models: list[Model],
    base: dict | None,
    scopes: list[Scope],
    where: str,
    at: Where,
    *,
    always_weights: bool,
) -> dict:
    """mergekit ``linear``: Σ w_m·W_m / Σ w_m over every listed model (BASE included when listed).
    ``always_weights``: task arithmetic even for two models (weights that vary by tensor)."""
    _check_all(models, scopes, {"weight"}, {"normalize"}, "linear")
    inputs = list(models)
    if base is not None and not any(_same(m[0], base) for m in inputs):
        if _get("weight", scopes, None, at) is None:
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
    for (_, _, w), v in zip(inputs, _resolve("weight", inputs, scopes, None, at), strict=True):
        if v is None:
            raise InputError(f"{w}: merge_method linear needs a weight for every model (parameters.weight)")
        weights.append(_number(v, "weight", f"{w}.parameters"))
    normalize = _bool(_get("normalize", scopes, True, at), "normalize", scopes[0][1])
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
                f"{where}: merge_method linear with normalize: false and weights summing to {total:g} scales "
                "the whole model; dghard merges task vectors (weights summing to 1)"
            )
        coef = weights
    b = next((i for i, m in enumerate(inputs) if base is not None and _same(m[0], base)), 0)
    others = [(m[0], c) for i, (m, c) in enumerate(zip(inputs, coef, strict=True)) if i != b]
    out: dict = {"base": inputs[b][0]}
    if len(others) == 1 and 0.0 <= others[0][1] <= 1.0 and not always_weights:
        out.update(method="wise-ft", models=[others[0][0]], alpha=others[0][1])
    else:
        out.update(
            method="task-arithmetic", models=[{**ref, "weight": c} for ref, c in others], **{"lambda": 1.0}
        )
    return out


class TensorParameters:
    """A mergekit recipe's parameters evaluated per tensor, as mergekit evaluates them: a
    gradient (list) is interpolated at the tensor's layer fraction ``layer / (layers − 1)`` (0
    for tensors outside the decoder layers: embeddings, final norm, lm_head), a filter matches
    when it is a substring of the tensor's name. Also checks that a ``slices`` recipe's one
    slice covers every layer."""

    def __init__(self, doc: dict, where: str, fixed: frozenset[str] = frozenset()) -> None:
        self.doc, self.where = doc, where
        self.layers = slice_layers(doc, where)
        self.fixed = fixed  # parameters given on the command line: they win

    def without(self, names: set[str]) -> TensorParameters:
        """The same, leaving the parameters ``names`` (given on the command line) alone."""
        return TensorParameters(self.doc, self.where, self.fixed | frozenset(names))

    def check(self, num_layers: int) -> None:
        if self.layers is not None and self.layers != num_layers:
            raise InputError(
                f"{self.where}: slices[0] takes layers [0, {self.layers}) of models with {num_layers} layers: "
                "a partial model (a frankenmerge); dghard merges whole models"
            )

    def __call__(self, name: str, num_layers: int) -> dict:
        """The method parameter values (by parameter name, see the registry) for tensor ``name``."""
        from dghard_cli.architecture import layer_index
        from dghard_cli.methods import registry

        i = layer_index(name)
        t = 0.0 if i is None else (i / (num_layers - 1) if num_layers > 1 else 1.0)
        r = translate(self.doc, f"{self.where} (tensor {name!r})", Where(name, t))
        params = registry.params()
        out = {k: v for k, v in r.items() if k in params and params[k].recipe}
        if any("weight" in m for m in r["models"]):
            out["weights"] = [m.get("weight", 1.0) for m in r["models"]]
        if any("density" in m for m in r["models"]):
            out["density"] = [m.get("density") for m in r["models"]]
        return {k: v for k, v in out.items() if k not in self.fixed}
