#!/usr/bin/env bash
# Post-fine-tune gate: audit-lora (LoRA runs) -> repair -> evaluate -> score --fail-under.
#
# Usage:
#   post_finetune.sh --base BASE --ft FT --eval 'CMD {model} {output}' [--adapter ADAPTER]
#                    [--out DIR] [--fail-under HM] [--target TASK]... [-- REPAIR_OPTIONS...]
#
# Every option can come from the environment instead (the command line wins):
#   BASE, FT          base and fine-tuned checkpoints (directories or Hub ids; for a LoRA run,
#                     FT is the merged model)
#   ADAPTER           the LoRA adapter; when set, `dghard audit-lora` runs first
#   OUT               working directory (default: dghard-ci); the repaired model goes to
#                     OUT/repaired and everything worth keeping to OUT/artifacts
#   EVAL              evaluation command template; {model} and {output} are replaced by the
#                     model (directory or Hub id) and a results path OUT/artifacts/eval/NAME,
#                     both shell-quoted. The command writes a results JSON file at that path or
#                     an lm-evaluation-harness output directory there.
#   FAIL_UNDER        the bar for the repaired model's HM (default: 50)
#   TARGETS           benchmarks the fine-tune was for, comma-separated (scored apart)
#   BASE_RESULTS, FT_RESULTS   existing results of BASE / FT: skip evaluating them
#   REPAIR_OPTIONS    extra options for `dghard repair` (e.g. "--scale 1.5 --exclude lm_head")
#   DGHARD            how to run dghard (default: dghard; e.g. "python -m dghard_cli")
#   HTML              0 to skip the HTML page (which needs dghard[plot])
#
# Artifacts (OUT/artifacts): audit.json, dghard_report.json, repair.html, eval/*, score.json.
# Exit status: 0 the gate passed; 1 the gate failed or the audit found errors; 2 bad usage;
# anything else: the failing step's status.
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true  # bash 5.2: keep '&' literal in ${x//p/r}

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "post_finetune: error: $*" >&2; exit 2; }
step() { echo; echo "== $* =="; }

BASE=${BASE:-} FT=${FT:-} ADAPTER=${ADAPTER:-} OUT=${OUT:-dghard-ci} EVAL=${EVAL:-}
FAIL_UNDER=${FAIL_UNDER:-50} TARGETS=${TARGETS:-} HTML=${HTML:-1}
BASE_RESULTS=${BASE_RESULTS:-} FT_RESULTS=${FT_RESULTS:-}
read -r -a DG <<<"${DGHARD:-dghard}"
read -r -a REPAIR_EXTRA <<<"${REPAIR_OPTIONS:-}"

while [[ $# -gt 0 ]]; do
  case $1 in
    --base) BASE=${2:?--base needs a value}; shift 2 ;;
    --ft) FT=${2:?--ft needs a value}; shift 2 ;;
    --adapter) ADAPTER=${2:?--adapter needs a value}; shift 2 ;;
    --out) OUT=${2:?--out needs a value}; shift 2 ;;
    --eval) EVAL=${2:?--eval needs a value}; shift 2 ;;
    --fail-under) FAIL_UNDER=${2:?--fail-under needs a value}; shift 2 ;;
    --target) TARGETS=${TARGETS:+$TARGETS,}${2:?--target needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; REPAIR_EXTRA+=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n $BASE ]] || die "BASE is not set (--base or BASE=...)"
[[ -n $FT ]] || die "FT is not set (--ft or FT=...)"
[[ -n $EVAL ]] || die "EVAL is not set: a command template with {model} and {output} (--eval or EVAL=...)"
[[ $EVAL == *"{model}"* && $EVAL == *"{output}"* ]] || die "EVAL must contain {model} and {output}"
[[ $FAIL_UNDER =~ ^-?[0-9]+([.][0-9]+)?$ ]] || die "FAIL_UNDER '$FAIL_UNDER' is not a number"

ART=$OUT/artifacts
MODEL=$OUT/repaired
mkdir -p "$ART/eval"

evaluate() {  # evaluate NAME MODEL -> prints the results path
  local name=$1 model=$2 out=$ART/eval/$1 cmd=$EVAL
  rm -rf "$out"
  cmd=${cmd//\{model\}/$(printf '%q' "$model")}
  cmd=${cmd//\{output\}/$(printf '%q' "$out")}
  echo "+ $cmd" >&2
  bash -c "$cmd" >&2 || { echo "post_finetune: the evaluation of $name failed" >&2; return 3; }
  [[ -e $out ]] || { echo "post_finetune: the evaluation of $name wrote nothing at $out" >&2; return 3; }
  echo "$out"
}

if [[ -n $ADAPTER ]]; then
  step "audit-lora $ADAPTER"
  rc=0
  "${DG[@]}" audit-lora "$ADAPTER" --base "$BASE" --fail-on error --json >"$ART/audit.json" || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "post_finetune: audit-lora exited $rc; see $ART/audit.json" >&2
    exit "$rc"
  fi
  echo "audit passed: $ART/audit.json"
else
  step "audit-lora skipped (no ADAPTER)"
fi

step "repair $FT against $BASE -> $MODEL"
"${DG[@]}" repair "$BASE" "$FT" "$MODEL" --overwrite ${REPAIR_EXTRA[@]+"${REPAIR_EXTRA[@]}"}
cp "$MODEL/dghard_report.json" "$ART/dghard_report.json"
if [[ $HTML != 0 ]]; then
  "${DG[@]}" report "$MODEL/dghard_report.json" --html "$ART/repair.html" --quiet
  echo "html: $ART/repair.html"
fi

step "evaluate"
if [[ -n $BASE_RESULTS ]]; then base_res=$BASE_RESULTS; else base_res=$(evaluate base "$BASE"); fi
if [[ -n $FT_RESULTS ]]; then ft_res=$FT_RESULTS; else ft_res=$(evaluate ft "$FT"); fi
rep_res=$(evaluate repaired "$MODEL")

step "score (gate: HM >= $FAIL_UNDER)"
score_args=(--base "$base_res" --ft "$ft_res" --candidate "repaired=$rep_res" --fail-under "$FAIL_UNDER")
IFS=',' read -r -a targets <<<"$TARGETS"
for t in ${targets[@]+"${targets[@]}"}; do [[ -n $t ]] && score_args+=(--target "$t"); done
rc=0
"${DG[@]}" score "${score_args[@]}" --report "$ART/score.json" || rc=$?
echo
if [[ $rc -eq 0 ]]; then
  echo "post_finetune: gate passed; artifacts in $ART"
else
  echo "post_finetune: gate failed (exit $rc); artifacts in $ART" >&2
fi
exit "$rc"
