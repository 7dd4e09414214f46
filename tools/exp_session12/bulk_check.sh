# Session 12's prepared check of v6 with bulk copies (branch exp/session12-v6-bulk), for the H200:
# the v6 CUDA tests with the bulk path on (a switched-off v6 is an error), then bulk against
# cp.async, with and without the maths, in one run. Run from the repository root: bash tools/exp_session12/bulk_check.sh
export PYTHONPATH=.
OUT=${OUT:-/tmp}
timeout 200 python -W error::RuntimeWarning -m pytest -q tests/test_attention_kernels.py -k "v6 and cuda" -p no:cacheprovider 2>&1 | tail -3
timeout 300 python tools/bench_decode_v6.py --shapes 8x32768,32x32768,16x16384,64x4096,32x4096,4x32768 --stages 3,4 \
    --launcher-segments --probe --copies both --out "$OUT/session13_v6_bulk.txt" 2>&1 | tail -7
