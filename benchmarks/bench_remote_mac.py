"""What a MAC key costs the shared tier per page (`RemoteTierConfig(mac_key=...)`).

Times `PageCodec.seal` (the writer thread's work per page: header, checksum, and with a
key the HMAC-SHA256 tag) and `PageCodec.decode` (the scheduling thread's work per page
hit: every check, and with a key the tag) without and with a MAC key, on the CPU, no
server involved (a round trip's cost is `bench_remote.py`'s). Best of 5 runs of
`--pages` pages each. Pages of two layouts: the demo decoder's (f32, page 16, 4 layers,
2 KV heads, head_dim 64: 64 KiB) and Llama-3.2-1B's (bf16, page 128, 16 layers, 8 KV
heads, head_dim 64: 4 MiB per shard).

Usage: python benchmarks/bench_remote_mac.py [--pages N]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
from max.dtype import DType
from mokv.remote import PageCodec, Rejection, RemoteLayout

LAYOUTS = {
    "decoder f32 p16 (64 KiB)": RemoteLayout(DType.float32, 16, 4, 2, 64),
    "Llama-3.2-1B bf16 p128 (4 MiB)": RemoteLayout(DType.bfloat16, 128, 16, 8, 64),
}
KEY = b"a secret the servers share, 32 B"


def per_page(layout: RemoteLayout, mac_key: bytes | None, num_pages: int) -> tuple[float, float]:
    """Seconds per page to seal and to decode."""
    codec = PageCodec(layout, "bench", mac_key)
    page = np.random.default_rng(0).bytes(layout.page_nbytes)
    tokens = np.arange(layout.page_size, dtype="<i8").tobytes()
    values = [codec.new_value(h, tokens, page) for h in range(num_pages)]

    def seal() -> None:
        for h, value in enumerate(values):
            codec.seal(value, h)

    def decode() -> None:
        for h, value in enumerate(values):
            codec.decode(bytes(value), h, tokens)

    seal_s = min(timeit.repeat(seal, number=1, repeat=5)) / num_pages
    decoded = [codec.decode(bytes(value), h, tokens) for h, value in enumerate(values)]
    assert all(
        not isinstance(d, Rejection) and bytes(d) == page for d in decoded
    )  # every value passed every check
    return seal_s, min(timeit.repeat(decode, number=1, repeat=5)) / num_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    args = parser.parse_args()
    print("| page | seal, no key | seal, MAC key | decode, no key | decode, MAC key | MAC |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, layout in LAYOUTS.items():
        pages = max(4, args.pages * 2**16 // layout.page_nbytes)
        plain_seal, plain_decode = per_page(layout, None, pages)
        mac_seal, mac_decode = per_page(layout, KEY, pages)
        extra = (mac_decode - plain_decode + mac_seal - plain_seal) / 2
        print(
            f"| {name} | {plain_seal * 1e6:,.0f} us | {mac_seal * 1e6:,.0f} us | "
            f"{plain_decode * 1e6:,.0f} us | {mac_decode * 1e6:,.0f} us | "
            f"+{extra * 1e6:,.0f} us/page each side, "
            f"{layout.page_nbytes / extra / 1e9:.1f} GB/s |"
        )


if __name__ == "__main__":
    main()
