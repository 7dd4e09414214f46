"""Session 16 probe: plain pyzmq PUSH/PULL throughput over K parallel TCP connections.

K PUSH sockets in a spawned sender (a context with K ZeroMQ I/O threads) send ``msgs`` 8 MiB
messages round-robin, ``copy=False``, to K PULL sockets here (K I/O threads); timed from the
"go" to the last message received (median of 8 after a warm-up). ``work=1``: the receiver also
copies each message into one of 8 pre-allocated 8 MiB buffers and xxh3_64s the copy, on 4
threads, i.e. the least a verify-then-write receiver does. Does striping a transfer over
several connections raise loopback throughput? Run: ``python3 tools/exp_session16/lanes.py``.
"""
import multiprocessing as mp, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np, zmq, xxhash

MSG = 8 << 20
NMSG = 16

def sender(conn, eps, k):
    ctx = zmq.Context(io_threads=k)
    socks = []
    for ep in eps:
        s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.LINGER, 0); s.connect(ep); socks.append(s)
    buf = np.random.randint(0, 256, MSG, dtype=np.uint8)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "exit": break
        nmsg = cmd
        for i in range(nmsg):
            socks[i % k].send(buf, copy=False)
    ctx.destroy(0)

def main():
    mp.set_start_method("spawn")
    out = []
    for work in (0, 1):
        for k in (1, 2, 4, 8):
            for nmsg in (4, 16):
                ctx = zmq.Context(io_threads=k)
                pulls, eps = [], []
                for _ in range(k):
                    s = ctx.socket(zmq.PULL); s.setsockopt(zmq.LINGER, 0)
                    port = s.bind_to_random_port("tcp://127.0.0.1"); pulls.append(s); eps.append(f"tcp://127.0.0.1:{port}")
                a, b = mp.Pipe()
                p = mp.Process(target=sender, args=(b, eps, k)); p.start()
                a.recv()
                poller = zmq.Poller()
                for s in pulls: poller.register(s, zmq.POLLIN)
                ex = ThreadPoolExecutor(4)
                dst = [np.empty(MSG, np.uint8) for _ in range(8)]
                def job(f, j):
                    d = dst[j % 8]; np.copyto(d, np.frombuffer(f.buffer, np.uint8)); return xxhash.xxh3_64_intdigest(d)
                times = []
                for rep in range(9):
                    t0 = time.perf_counter(); a.send(nmsg); got = 0; futs = []
                    while got < nmsg:
                        for s, _ in poller.poll(1000):
                            while True:
                                try: f = s.recv(zmq.NOBLOCK, copy=False)
                                except zmq.Again: break
                                if work: futs.append(ex.submit(job, f, got))
                                got += 1
                    for f in futs: f.result()
                    times.append(time.perf_counter() - t0)
                a.send("exit"); p.join()
                ctx.destroy(0); ex.shutdown()
                med = statistics.median(times[1:])
                line = f"work={work} lanes={k} msgs={nmsg} MiB={nmsg*8} median_ms={med*1e3:.2f} GB/s={nmsg*MSG/med/1e9:.2f} min_ms={min(times[1:])*1e3:.2f}"
                print(line, flush=True)
if __name__ == "__main__":
    main()
