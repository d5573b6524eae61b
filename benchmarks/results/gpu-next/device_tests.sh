# call 1 of make_payload.sh: the CUDA checks, from a copy of the tree, started with setsid so that call 2 can
# collect /root/tests.log. The tiny-model tests put the target on the GPU with ANCHORSPEC_TEST_DEVICE=cuda
# (tests/helpers.py); session 40 saw them fail at the first drafter pass (the drafter stayed on the CPU),
# session 42 at the dynamic tree (host scores + device log-probs); tests/device_emulation.py now checks
# CUDA's device rules on a CPU. The full logs go back too (device_go.sh: tests-*.log).
cd /root/repo
export PYTHONPATH=/root/site:/root/repo
T0=$(date +%s)
echo "== train on CUDA (float64 against the CPU, bf16 autocast, evaluation decoding)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "cuda or device" > /root/tests-train.log 2>&1
grep -E "^E  |^(anchorspec|tests)/[^ ]*:[0-9]+|passed|failed" /root/tests-train.log | tail -30
echo "== lossless decoding with the target on CUDA: greedy float64 (chains, trees, families, batches), sampling"
ANCHORSPEC_TEST_DEVICE=cuda timeout 360 python3 -m pytest -q -p no:cacheprovider -rf --maxfail=30 \
  tests/test_lossless.py tests/test_batch.py tests/test_sampling_e2e.py tests/test_fallback.py \
  tests/test_shared_prefix.py tests/test_regenerate.py tests/test_magpie.py tests/test_device_rules.py \
  > /root/tests-decode.log 2>&1
grep -E "^E  |^(anchorspec|tests)/[^ ]*:[0-9]+|passed|failed" /root/tests-decode.log | sort | uniq -c | sort -rn | head -60
echo "== tests done: $(( $(date +%s) - T0 )) s"
