"""Session 16: the tensor-core INT4 writer with the first stage across parts in the tensor core's
accumulator (``pair_acc``: ``H·x1`` accumulated onto ``H·x0``, once negated) or as fp32 adds.

Offline sm_90 (Triton 3.6, the H200's specialization): 1,120 -> 1,104 SASS per program at head_size
128 (98 registers), 736 -> 712 at 64, 2,120 -> 2,056 at 256 (167 -> 175 registers). Same checks and
interleaved rounds as the session-15 probe. Run: ``PYTHONPATH=. python3
tools/exp_session16/probe_write_pair_acc.py [--rounds 3] [--shapes 65536x128,...]``.
"""
from tools.exp_session15.probe_write_packed import main

VARIANTS = [("default", lambda d: dict(kernel="mma")),
            ("pair_acc", lambda d: dict(kernel="mma", pair_acc=True))]

if __name__ == "__main__":
    main(VARIANTS)
