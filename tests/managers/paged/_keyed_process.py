"""One side of test_extra_keys.py's two-process test, in its own interpreter (another
hash seed): a paged manager with the shared tier serves the requests named on stdin,
each under its own adapter and images, so that their pages reach Redis.

Run as `python -m tests.managers.paged._keyed_process URL NAMESPACE` from the repository
root. stdin: one JSON line, a list of [request_id, lora_name, images] (images:
[[identifier, offset, length], ...]). stdout: one JSON line, each request's committed
hash chain.
"""

import json
import sys

import mokv
from max.driver import CPU
from max.engine import InferenceSession

from tests.managers.conftest import make_paged
from tests.managers.paged.test_extra_keys import keyed

url, namespace = sys.argv[1:3]
m = make_paged(InferenceSession(devices=[CPU()]), num_pages=16, max_seq_len=24,
               tiers=(mokv.RemoteTierConfig(url=url, namespace=namespace),))
chains = {}
for request_id, lora, images in json.loads(sys.stdin.readline()):
    ctx = keyed(request_id, lora, images)
    m.external_claim(request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    chains[request_id] = m.replicas[0].committed_hashes(request_id)
    m.release(request_id)
for store in m.replicas[0].tiers.named("remote").stores:
    assert store.flush(10)
m.close()
print(json.dumps(chains), flush=True)
