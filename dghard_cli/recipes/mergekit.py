"""mergekit recipes as input: ``dghard merge --config mergekit.yml --out OUT``.

:func:`translate` is a pure function from a mergekit 0.1.5 configuration (the dict
``yaml.safe_load`` gives for a ``mergekit-yaml`` file) to a dghard recipe dict (the format of
:mod:`dghard_cli.recipes.recipe`), with the same numbers: every mergekit default is filled in
explicitly (``density`` 1, ``lambda`` 1, ``normalize`` per method, ...), so a recipe means what
it meant under mergekit. Parameters that vary by layer or tensor — gradients (lists),
``filter``/``value`` entries, one density per model — are evaluated per tensor as mergekit
evaluates them (:class:`TensorParameters`), and a ``slices`` recipe whose one slice takes every
layer of every source is a whole-model merge. What dghard does not do is a one-line
:class:`InputError` naming the key: layer-range assembly and passthrough (frankenmerges), MoE
configurations, tokenizer surgery and chat templates, methods dghard does not have. A
``model+lora`` reference is read as the adapter, a fine-tune of ``model`` (which must be
``base_model``).

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

The code is in three modules: :mod:`dghard_cli.recipes.mergekit_config` (reading the
configuration and evaluating its parameters for a tensor), :mod:`dghard_cli.recipes.mergekit_mapping`
(``linear`` and the task-arithmetic family mapped onto dghard's methods) and this one
(:func:`translate`, :class:`TensorParameters`).
"""

from __future__ import annotations

from dghard_cli.architecture import layer_index
from dghard_cli.errors import InputError
from dghard_cli.methods import registry
from dghard_cli.recipes.mergekit_config import (
    Where,
    _bool,
    _check_all,
    _dtype,
    _get,
    _models,
    _number,
    _ref,
    _refuse_structure,
    _same,
    is_mergekit,
    lora_references,
    slice_layers,
    tokenizer_source,
    varies,
)
from dghard_cli.recipes.mergekit_mapping import GTA, _linear, _task_vectors

__all__ = ["TensorParameters", "is_mergekit", "translate", "varies"]

OTHER_METHODS = ("linear", "slerp", "model_stock")
SUPPORTED = (*OTHER_METHODS[:1], *GTA, *OTHER_METHODS[1:])
#: mergekit 0.1.5's merge methods that dghard does not run, each with the nearest dghard method
NOT_HERE = {
    "passthrough": "passthrough stacks layers (a frankenmerge); dghard merges whole models of one "
    "architecture (nearest: none)",
    "nuslerp": "nuslerp is not in dghard; the nearest is slerp (merge_method: slerp, t: ...)",
    "multislerp": "multislerp is not in dghard; the nearest is slerp (base_model and one other model)",
    "karcher": "karcher (the mean on the sphere) is not in dghard; the nearest is linear "
    "(dghard task-arithmetic with equal weights)",
    "sce": "sce is not in dghard; the nearest is ties (trim, elect signs, disjoint merge)",
    "ram": "ram is not in dghard; the nearest is ties (a disjoint merge of the task vectors)",
    "ramplus_tl": "ramplus_tl is not in dghard; the nearest is ties (a disjoint merge of the task vectors)",
    "nearswap": "nearswap is not in dghard; the nearest is wise-ft (merge_method: linear with base_model "
    "and one model: one interpolation weight for every element)",
    "arcee_fusion": "arcee_fusion is not in dghard; the nearest is breadcrumbs (only the task vector's "
    "selected entries)",
}


def translate(doc: dict, where: str, at: Where | None = None) -> dict:
    """The dghard recipe (method, base, models, parameters, dtype) meaning what ``doc`` means in
    mergekit 0.1.5, with its parameters evaluated for the tensor ``at`` (default: outside any
    filter, layer fraction 0); InputError (one line, naming the key) for what dghard does not do."""
    at = at or Where()
    _refuse_structure(doc, where)
    doc = lora_references(doc, where)
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
    if tokenizer_source(doc, where) is not None:
        out["tokenizer_source"] = "base"
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
