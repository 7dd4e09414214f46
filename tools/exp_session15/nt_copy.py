"""Session 15: does glibc's non-temporal copy threshold speed up the decode side's scatter into a cold cache?

An 8 MiB message scattered as 128 random 64 KiB rows into a 1 GiB array: numpy fancy assignment (what
``kvconnector`` does per frame) and libc ``memcpy`` per row, median of 40. Run it plain and with
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x8000`` (read by glibc at process start only):
``python3 tools/exp_session15/nt_copy.py``. Results: docs/bench/transfer.md, "Session 15".
"""
import numpy as np, time, ctypes
rows = 64 << 10  # 64 KiB block rows
cache = np.zeros((16384, rows), dtype=np.uint8)  # 1 GiB destination
cache[:] = 1
frame = np.random.randint(0, 255, size=(128, rows), dtype=np.uint8)  # 8 MiB message
rng = np.random.default_rng(0)
ts = []
for it in range(40):
    idx = rng.choice(16384, 128, replace=False)
    t = time.perf_counter(); cache[idx] = frame; ts.append(time.perf_counter() - t)
ts.sort()
print("fancy assign 8 MiB: median %.2f ms -> %.1f GB/s" % (ts[len(ts)//2] * 1e3, 8 * 2**20 / ts[len(ts)//2] / 1e9))
libc = ctypes.CDLL("libc.so.6")
ts = []
for it in range(40):
    idx = rng.choice(16384, 128, replace=False)
    t = time.perf_counter()
    for j, r in enumerate(idx):
        libc.memcpy(ctypes.c_void_p(cache[r].ctypes.data), ctypes.c_void_p(frame[j].ctypes.data), rows)
    ts.append(time.perf_counter() - t)
ts.sort()
print("memcpy per row 8 MiB: median %.2f ms -> %.1f GB/s" % (ts[len(ts)//2] * 1e3, 8 * 2**20 / ts[len(ts)//2] / 1e9))
