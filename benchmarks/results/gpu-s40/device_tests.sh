# call 1 of make_payload.sh: CUDA checks from a copy of the tree, started with setsid so call 2 can collect /root/tests.log
cd /root/repo
export PYTHONPATH=/root/site:/root/repo
echo "== train on CUDA (float64 equality with the CPU, bf16 autocast, evaluation decoding)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "cuda or device" 2>&1 | tail -40
echo "== tiny-model lossless tests with the target on CUDA (session 40 saw a drafter left on the CPU; attach_drafter now moves it)"
ANCHORSPEC_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider --maxfail=5 tests/test_lossless.py tests/test_batch.py tests/test_sampling_e2e.py 2>&1 | tail -60
echo "== tests done"
