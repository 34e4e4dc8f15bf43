"""What the secure sum costs as the consortium grows: bytes each hospital sends and receives per secure sum,
and wall time, for H hospitals and a contribution of L integers (server/secure.py, clients/secure.py).

    .venv/bin/python benchmarks/secure_sum_cost.py [H,H,...] [L] [DROPPED]
    e.g. benchmarks/secure_sum_cost.py 3,10,30,100 144 1

All parties run in this process (one core): the wall time is the whole protocol's compute, every hospital's
and the server's together, not what one party waits for over a network. ``DROPPED`` hospitals leave after
sharing their keys (the server then rebuilds their masking keys and removes their pairwise masks).
Contributions are zero vectors: the cost does not depend on them. Prints one JSON line per H.
"""

import json
import sys
import time

import numpy as np

from clients.secure import SecurePolicy, SecureSumParty
from server.secure import secure_sum


def run(hospitals: int, length: int, dropped: int) -> dict:
    names = [f"h{i:03d}" for i in range(hospitals)]
    policy = SecurePolicy(dropouts=dropped)
    parties = {n: SecureSumParty(n, policy) for n in names}
    leaving = set(names[:dropped])
    seconds = {"setup": 0.0, "share-keys": 0.0, "collect-masked": 0.0, "unmask": 0.0}

    def exchange(stage, messages):
        started = time.perf_counter()
        replies = {}
        for name, message in messages.items():
            if name in leaving and stage in ("collect-masked", "unmask"):
                continue
            replies[name] = parties[name].handle(stage, message, lambda _m: np.zeros(length, np.int64))
        seconds[stage] += time.perf_counter() - started
        return replies

    counted = policy.counted_shares(hospitals)
    threshold = max(2, hospitals // 2 + 1)
    started = time.perf_counter()
    result = secure_sum(exchange, names, threshold, 40, length,
                        {"local_variance": 1.0, "shares": counted, "total_variance": float(counted),
                         "colluders": policy.colluders, "dropouts": policy.dropouts})
    total = time.perf_counter() - started
    survivors = result.survivors
    return {"hospitals": hospitals, "length": length, "dropped": dropped, "threshold": threshold,
            "wall_seconds": round(total, 3), "server_seconds": round(total - sum(seconds.values()), 3),
            "hospital_seconds_by_stage": {k: round(v, 3) for k, v in seconds.items()},
            "bytes_up_per_hospital": float(np.mean([result.bytes_up[h] for h in survivors])),
            "bytes_down_per_hospital": float(np.mean([result.bytes_down[h] for h in survivors])),
            "masked_vector_bytes": 8 * length}


if __name__ == "__main__":
    sizes = [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "3,10,30").split(",")]
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 144
    dropped = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    for h in sizes:
        print(json.dumps(run(h, length, dropped)), flush=True)
