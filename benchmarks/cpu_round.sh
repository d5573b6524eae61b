#!/usr/bin/env bash
# One CPU training round of a released drafter, from training to release (what sessions 50-54 did by hand).
# VARIANT=eagle3 (default) or eagle3.1 picks the release it continues, evaluates against and replaces.
#   bash benchmarks/cpu_round.sh train N [--resume]   continue the release for STEPS (1800) steps on the whole corpus
#                                                     in a batch order of its own (--order-seed N) at peak lr LR
#                                                     (default 3e-4); resumable
#   bash benchmarks/cpu_round.sh eval N               round N (final, converted to bf16 as it would ship) against the
#                                                     release on MT-bench 1-10 and on 16 prompts of the other
#                                                     categories (float32, tree 4,4,16, T=0 and T=1), then
#                                                     llama.cpp with round N's GGUF (SKIP_PEERS=1 skips it;
#                                                     an EAGLE-3.1 round always does)
#   bash benchmarks/cpu_round.sh release N            copy round N (its final step) into checkpoints/ and add its scaling point
#                                                     (TAU=<its T=0 tau from eval>); the model card is edited by hand
# REVOCAB= (empty) keeps the release's draft vocabulary: re-selecting it from a small subset of the corpus swapped
# 22 % of its rows and cost MT-bench tau (session 61). Later options override earlier ones: `train N --data A B
# --max-len 4096 --batch-tokens 4096 --join-to 4096` trains on other data at long positions.
# INIT (default: the release) is the drafter training starts from; a round from another start (session 55: a fold
# of the EAGLE-3.1 release) gives release mode BASE_TOKENS, that start's cumulative token-steps.
# RUN (default $ANCHORSPEC_HOME/runs/smollm2-135m-instruct/VARIANT-rN) holds the run; results go to OUT
# (default benchmarks/results/VARIANT-rN). Run it on a quiet machine: tests and benchmarks beside training distort both.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: cpu_round.sh train|eval|release ROUND [train options]}
N=${2:?usage: cpu_round.sh train|eval|release ROUND [train options]}
shift 2
HOME_DIR=${ANCHORSPEC_HOME:-$HOME/.cache/anchorspec}
VARIANT=${VARIANT:-eagle3}
case $VARIANT in eagle3|eagle3.1) ;; *) echo "cpu_round.sh: VARIANT must be eagle3 or eagle3.1, got '$VARIANT'" >&2; exit 2 ;; esac
RUN=${RUN:-$HOME_DIR/runs/smollm2-135m-instruct/$VARIANT-r$N}
OUT=${OUT:-benchmarks/results/$VARIANT-r$N}
RELEASE=checkpoints/smollm2-135m-instruct-$VARIANT
SHIPPED=$RUN/../$VARIANT-r$N-bf16
case $MODE in
train)
  anchorspec train --target smollm2-135m-instruct --data corpus/smollm2-135m-instruct --variant "$VARIANT" \
    --init-from "${INIT:-$RELEASE}" ${REVOCAB---revocab} --order-seed "$N" \
    --max-steps "${STEPS:-1800}" --lr "${LR:-3e-4}" --warmup-ratio 0.03 --ttt-steps 4 --batch-tokens 2048 --max-len 1024 \
    --dtype bfloat16 --threads 2 --heldout 0.02 --eval-every 100000 --eval-heldout 256 --eval-replay 16 \
    --eval-prompts 4 --eval-new-tokens 64 --save-every 100 --out "$RUN" "$@" ;;
eval)
  [ -f "$RUN/final/model.safetensors" ] || { echo "cpu_round.sh: $RUN/final is missing: train round $N first" >&2; exit 2; }
  anchorspec convert-drafter "$RUN/final" --out "$SHIPPED" --dtype bfloat16
  mkdir -p "$OUT"
  rm -f "$HOME_DIR"/shapes/*   # the shape cache must not carry costs measured under other load
  python benchmarks/bench_drafters.py --drafter $VARIANT-release=$RELEASE --drafter $VARIANT-r$N="$SHIPPED" \
    --limit 10 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 --out "$OUT/mtbench10-fp32-tree4416.json"
  # MT-bench 1-10 are all writing: round 12 was level there and gained on the other seven categories (session 54)
  python benchmarks/bench_drafters.py --drafter $VARIANT-release=$RELEASE --drafter $VARIANT-r$N="$SHIPPED" \
    --limit 16 --every 4 --offset 12 --dtype float32 --shape 4,4,16 --temperature1 --threads 2 \
    --out "$OUT/mtbench16-every4-offset12-fp32-tree4416.json"
  # llama.cpp has neither fc_norm nor norm_output: an EAGLE-3.1 round has no GGUF to run there
  [ -n "${SKIP_PEERS:-}" ] || [ "$VARIANT" = eagle3.1 ] || python benchmarks/peers.py --limit 10 --threads 2 --skip hf,fast,vllm \
    --drafter "$SHIPPED" --out "$OUT/peers" ;;
release)
  : "${TAU:?set TAU to the MT-bench 1-10 T=0 tau of round $N from eval}"
  [ -f "$SHIPPED/model.safetensors" ] || { echo "cpu_round.sh: $SHIPPED is missing: run eval $N first" >&2; exit 2; }
  cp "$SHIPPED/model.safetensors" "$SHIPPED/config.json" "$RUN/run.json" "$RUN/training.png" $RELEASE/
  # the release ships final/ (eval converts it), so best.json describes the final step's evaluation, not the run's
  # best/ (which can name step 0, the drafter it started from, when a few replayed answers scored it higher)
  python - "$RUN/metrics.jsonl" "$N" > $RELEASE/best.json <<'EOF'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "eval" in r]
last = evals[-1]
print(json.dumps({"step": last["step"], **last["eval"],
                  "note": f"round {sys.argv[2]}: the end of its schedule, the weights released"}, indent=1))
EOF
  # cumulative token-steps: the last earlier scaling point's plus this run's own (seconds x tokens/s); and the
  # assistant tokens of the data it trained on (the curve's "regenerated" column), both from one read of run.json
  COUNTS=$(python - "$RUN/run.json" benchmarks/results/scaling/smollm2-135m-instruct.json "$N" "${BASE_TOKENS:-}" "$VARIANT" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
points = [p for p in json.load(open(sys.argv[2]))["points"] if p["variant"] == sys.argv[5] and p["round"] < int(sys.argv[3])]
base = float(sys.argv[4]) if sys.argv[4] else max(points, key=lambda p: p["round"])["tokens"]
steps = run["summary"]["train_seconds"] * run["summary"]["train_tokens_per_s"]
print(int(round(base + steps, -4)), int(round(run["data"]["loss_tokens"], -4)))
EOF
)
  read -r TOKENS REGEN <<< "$COUNTS"
  python benchmarks/scaling_curve.py --add "$N" "$VARIANT" "$TOKENS" "$REGEN" "$TAU"
  echo "round $N in $RELEASE: $TOKENS token-steps in all; now edit $RELEASE/README.md" ;;
*) echo "cpu_round.sh: unknown mode '$MODE' (train, eval or release)" >&2; exit 2 ;;
esac
