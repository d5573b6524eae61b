#!/usr/bin/env bash
# session 24: the same 24 Magpie prompts answered greedily by four engines (1 thread each, in turn)
set -uo pipefail
cd /work/main
E=$ANCHORSPEC_HOME/runs/r24/endpoint
BIN=$ANCHORSPEC_HOME/peers/llama.cpp/bin
COMMON="--target smollm2-135m-instruct --data $E/prompts.jsonl --max-new-tokens 192 --max-prompt-tokens 512 --seed 0"
python -m anchorspec regenerate $COMMON --dtype float32 --batch-size 8 --threads 1 --out $E/pytorch-fp32.jsonl > $E/fp32.log 2>&1
python -m anchorspec regenerate $COMMON --dtype bfloat16 --batch-size 8 --threads 1 --out $E/pytorch-bf16.jsonl > $E/bf16.log 2>&1
Q4=$(python -c "from anchorspec.models.hub import alias_gguf; print(alias_gguf('smollm2-135m-instruct'))")
F32=$(python -c "from anchorspec.models.export_gguf import float32_alias_gguf; print(float32_alias_gguf('smollm2-135m-instruct'))")
for pair in "f32:$F32" "q4_1:$Q4"; do
  name=${pair%%:*}; gguf=${pair#*:}
  $BIN/llama-server -m $gguf --jinja -t 1 -np 1 -c 2048 --port 8091 > $E/server-$name.log 2>&1 &
  pid=$!
  for i in $(seq 60); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 1; done
  python -m anchorspec regenerate $COMMON --endpoint http://127.0.0.1:8091/v1 --concurrency 1 --out $E/llamacpp-$name.jsonl > $E/$name.log 2>&1
  kill $pid; wait $pid 2>/dev/null
done
echo done > $E/done
# then, by hand, the same prompts through llama-server with 8 parallel slots (for each GGUF):
#   $BIN/llama-server -m $gguf --jinja -t 1 -np 8 -c 16384 --port 8092 &
#   python -m anchorspec regenerate $COMMON --endpoint http://127.0.0.1:8092/v1 --concurrency 8 --out $E/llamacpp-$name-np8.jsonl
# and the comparison:
#   python benchmarks/endpoint_agreement.py --answers pytorch-fp32=$E/pytorch-fp32.jsonl --answers pytorch-bf16=$E/pytorch-bf16.jsonl \
#     --answers llamacpp-f32=$E/llamacpp-f32.jsonl --answers llamacpp-f32-np8=$E/llamacpp-f32-np8.jsonl \
#     --answers llamacpp-q4_1=$E/llamacpp-q4_1.jsonl --answers llamacpp-q4_1-np8=$E/llamacpp-q4_1-np8.jsonl \
#     --out benchmarks/results/endpoint/agreement-mag24.json
