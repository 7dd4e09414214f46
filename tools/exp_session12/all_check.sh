# Session 12's prepared checks for one H200 call (then branch exp/session12-v7-bulk, merged in
# session 13: v6 and v7 with bulk copies on sm_90, cp.async otherwise): the v6 and v7 CUDA tests
# (bulk on; a switched-off kernel is an error), then v6 bulk vs cp.async, then v7 (bulk /
# cp.async) vs v4 and bf16. Session 13's run: docs/bench/raw/session13_all_check.txt.
# Run from the repository root: OUT=... bash tools/exp_session12/all_check.sh
export PYTHONPATH=.
OUT=${OUT:-/tmp}
timeout 240 python -W error::RuntimeWarning -m pytest -q -x tests/test_attention_kernels.py -k "(v6 or v7) and cuda" -p no:cacheprovider 2>&1 | tail -4
timeout 150 python tools/bench_decode_v6.py --shapes 8x32768,32x32768,16x16384 --stages 3,4 --launcher-segments --probe \
    --copies both --out "$OUT/session13_v6_bulk.txt" 2>&1 | tail -4
timeout 200 python tools/exp_session12/bench_v7.py "$OUT/session13_v7.txt" 2>&1 | tail -12
