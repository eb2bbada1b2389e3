"""The mergekit methods that need more than a rename, mapped onto dghard's: ``linear`` (WiSE-FT
or task arithmetic over normalized weights) and the generalized task arithmetic family
(``task_arithmetic``, ``ties``, ``dare_*``, ``breadcrumbs*``, ``della*``) with mergekit's
defaults for ``normalize``, ``rescale``, ``density``, ``gamma``, ``epsilon`` and ``lambda``.

Relies on :mod:`dghard_cli.recipes.mergekit_config` for the parameter scopes and their
evaluation; :mod:`dghard_cli.recipes.mergekit` (``translate``) is the public entry.
"""

from __future__ import annotations

from dghard_cli.errors import InputError
from dghard_cli.recipes.mergekit_config import (
    Model,
    Scope,
    Where,
    _bool,
    _check_all,
    _get,
    _number,
    _one,
    _resolve,
    _same,
)

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
