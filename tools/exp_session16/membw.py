"""Session 16 probe: this host's copy and xxh3_64 rates, one thread and several (1 GiB buffers,
cold; 8 MiB, hot). Run: ``python3 tools/exp_session16/membw.py``."""
import time, threading, numpy as np, torch, xxhash
N = 1 << 30
a = torch.randint(0, 256, (N,), dtype=torch.uint8); b = torch.empty_like(a); b.fill_(1)
def t(f, reps=5):
    f(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return min(ts)
for n in (1, 2, 4, 8, 16):
    torch.set_num_threads(n)
    s = t(lambda: b.copy_(a))
    print(f"torch copy_ 1 GiB threads={n}: {s*1e3:.1f} ms, {N/s/1e9:.1f} GB/s copied ({2*N/s/1e9:.1f} GB/s traffic)", flush=True)
an, bn = a.numpy(), b.numpy()
s = t(lambda: np.copyto(bn, an)); print(f"numpy copyto 1 thread: {N/s/1e9:.1f} GB/s", flush=True)
s = t(lambda: xxhash.xxh3_64_intdigest(an)); print(f"xxh3 1 GiB 1 thread: {N/s/1e9:.1f} GB/s", flush=True)
for k in (2, 4, 8):
    parts = [(an[i*N//k:(i+1)*N//k], bn[i*N//k:(i+1)*N//k]) for i in range(k)]
    def par(fn):
        th = [threading.Thread(target=fn, args=p) for p in parts]; [x.start() for x in th]; [x.join() for x in th]
    s = t(lambda: par(lambda x, y: np.copyto(y, x))); print(f"numpy copyto {k} threads: {N/s/1e9:.1f} GB/s copied", flush=True)
    s = t(lambda: par(lambda x, y: xxhash.xxh3_64_intdigest(x))); print(f"xxh3 {k} threads: {N/s/1e9:.1f} GB/s", flush=True)
# small hot buffers (8 MiB, in L2/L3)
m = 8 << 20
x, y = an[:m], bn[:m]
s = t(lambda: np.copyto(y, x), 20); print(f"numpy copyto 8 MiB hot: {m/s/1e9:.1f} GB/s", flush=True)
s = t(lambda: xxhash.xxh3_64_intdigest(x), 20); print(f"xxh3 8 MiB hot: {m/s/1e9:.1f} GB/s", flush=True)
