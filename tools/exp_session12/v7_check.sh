# Session 12's prepared check of the experimental INT8 / FP8 decode v7 (branch
# exp/session12-v7-int8), for the H200: its CUDA tests, then the A/B against v4 and bf16.
# Run from the repository root: bash tools/exp_session12/v7_check.sh
export PYTHONPATH=.
OUT=${OUT:-/tmp}
timeout 240 python -m pytest -q -x tests/test_attention_kernels.py -k "v7" -p no:cacheprovider 2>&1 | tail -5
timeout 300 python tools/exp_session12/bench_v7.py "$OUT/session13_v7.txt" 2>&1 | tail -12
