"""Typed extra keys (`mokv.cache.extra_keys`): a LoRA adapter keys every page of its
requests, an image the pages it overlaps, each together with the cache salt; requests
with different keys never share those pages, equal ones do, in one process and across
two (through the shared tier, with another hash seed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mokv
import numpy as np
import pytest
from mokv import MultimodalInput, TextContext
from mokv.cache.extra_keys import chain_root
from mokv.cache.hashing import encode_extra_keys, iter_page_hashes, page_hash_fn, salted_root
from mokv.events import PrefixRouterIndex

from ...child_env import child_env
from ...remote.conftest import redis_server  # noqa: F401 (fixture)
from ..conftest import make_paged

ROOT = Path(__file__).resolve().parents[3]
P = 7  # an image's placeholder token: the same id for every image
PROMPT = [1, 2, 3, 4, 5, 6, P, P, P, P, P, P, 9, 9, 9, 9, 8]  # 4 full pages of 4, then 8
IMAGE = ["img-a", 6, 6]  # placeholder tokens 6-11: pages 1 and 2
FN = page_hash_fn("xxh3")


def keyed(request_id, lora=None, images=(), salt=None) -> TextContext:
    """A request of PROMPT under adapter `lora` with `images` ([identifier, offset,
    length] each)."""
    return TextContext(PROMPT, request_id, cache_salt=salt, lora_name=lora,
                       mm_inputs=[MultimodalInput(*image) for image in images])


def serve(m, ctx, num_pages=4) -> list[int]:
    """Prefills `ctx` and commits its `num_pages` full pages; returns their hashes
    (released)."""
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    chain = m.replicas[0].committed_hashes(ctx.request_id)
    m.release(ctx.request_id)
    assert len(chain) == num_pages
    return chain


def found(m, ctx) -> int:
    """Tokens of `ctx` the prefix cache supplies (reserved, then released)."""
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    m.release(ctx.request_id)
    return ctx.start_idx


def test_adapters_never_share_and_equal_adapters_do(session):
    m = make_paged(session, num_pages=16, max_seq_len=24)
    serve(m, keyed("math-1", lora="math"))
    assert found(m, keyed("code", lora="code")) == 0
    assert found(m, keyed("base")) == 0
    assert found(m, keyed("math-salted", lora="math", salt="tenant-a")) == 0
    assert found(m, keyed("math-2", lora="math")) == 16
    serve(m, keyed("base-1"))  # the base model's pages are not the adapter's either
    assert found(m, keyed("base-2")) == 16
    assert found(m, keyed("math-3", lora="math")) == 16
    serve(m, keyed("both-1", lora="math", salt="tenant-a"))
    assert found(m, keyed("both-2", lora="math", salt="tenant-a")) == 16
    assert found(m, keyed("salt-only", salt="tenant-a")) == 0


def test_an_image_keys_exactly_the_pages_it_overlaps(session):
    m = make_paged(session, num_pages=16, max_seq_len=24)
    text = serve(m, keyed("text"))
    image = serve(m, keyed("image", images=[IMAGE]))
    assert image[0] == text[0]  # page 0 holds no placeholder
    assert all(a != b for a, b in zip(image[1:], text[1:]))  # pages 1, 2 keyed; 3 inherits
    assert found(m, keyed("same", images=[IMAGE])) == 16
    assert found(m, keyed("other", images=[["img-b", 6, 6]])) == 4
    assert found(m, keyed("moved", images=[["img-a", 7, 5]])) == 4
    assert found(m, keyed("shorter", images=[["img-a", 6, 5]])) == 4
    assert found(m, keyed("plain")) == 16  # the text request's own chain
    # The definition: a keyed page's hash is H(H(parent, its keys), its tokens), the keys
    # tagged with the image's identifier, offset from the page's start, and length.
    data = np.asarray(PROMPT, dtype="<i8").tobytes()
    page1 = FN(FN(text[0], encode_extra_keys("mm", "img-a", 2, 6)), data[32:64])
    page2 = FN(FN(page1, encode_extra_keys("mm", "img-a", -2, 6)), data[64:96])
    assert image == [text[0], page1, page2, FN(page2, data[96:128])]


def test_two_images_in_one_page_and_an_adapter_compose(session):
    m = make_paged(session, num_pages=16, max_seq_len=24)
    images = [["img-a", 4, 2], ["img-b", 6, 2]]  # both in page 1
    chain = serve(m, keyed("two", lora="math", images=images))
    keys = {1: encode_extra_keys("mm", "img-a", 0, 2, "mm", "img-b", 2, 2)}
    root = chain_root("xxh3", 0, None, "math")
    assert chain == [h for h, _ in iter_page_hashes(np.asarray(PROMPT), 4, root, FN, 0, 4, keys)]
    assert found(m, keyed("swapped", lora="math", images=images[::-1][:1])) == 4


def test_a_salt_alone_keeps_its_hashes_and_the_router_hashes_alike(session):
    m = make_paged(session, num_pages=16, max_seq_len=24)
    salted = serve(m, keyed("salted", salt="tenant-a"))
    root = salted_root("xxh3", 0, "tenant-a")
    assert root == chain_root("xxh3", 0, "tenant-a", None)
    assert salted == [h for h, _ in iter_page_hashes(np.asarray(PROMPT), 4, root, FN, 0, 4)]
    index = PrefixRouterIndex(page_size=4)
    for rid, lora, images, salt in [("a", "math", [IMAGE], "tenant-a"), ("b", "math", [], None),
                                    ("c", None, [IMAGE], None), ("d", None, [], "tenant-a")]:
        chain = serve(m, keyed(rid, lora, images, salt))
        inputs = [MultimodalInput(*image) for image in images]
        assert index.page_hashes(PROMPT, salt, lora, inputs) == chain, rid


def test_contexts_check_their_keys():
    for kwargs, error, match in [
        (dict(lora_name=""), TypeError, "lora_name must be a non-empty str"),
        (dict(lora_name=3), TypeError, "lora_name"),
        (dict(lora_name="a", lora_id=-1), TypeError, "lora_id must be an int >= 0"),
        (dict(lora_id=2), ValueError, "lora_id=2 needs a lora_name"),
        (dict(mm_inputs=[("img", 0, 4)]), TypeError, r"\('img', 0, 4\)"),
        (dict(mm_inputs=MultimodalInput("img", 0, 4)), TypeError, "sequence"),
        (dict(mm_inputs=[MultimodalInput("a", 4, 4), MultimodalInput("b", 6, 2)]), ValueError,
         "ordered by offset and not overlap"),
        (dict(mm_inputs=[MultimodalInput("a", 14, 4)]), ValueError, "past the prompt's 17"),
        (dict(session_id=""), TypeError, "session_id"),
    ]:
        with pytest.raises(error, match=match):
            TextContext(PROMPT, **kwargs)
    for args, match in [(("", 0, 1), "identifier"), (("a", -1, 1), "offset"),
                        (("a", 0, 0), "length"), (("a", 0, 1.0), "length")]:
        with pytest.raises((TypeError, ValueError), match=match):
            MultimodalInput(*args)


def test_two_processes_share_pages_of_equal_keys_only(session, redis_server):  # noqa: F811
    namespace = f"keyed-{os.getpid()}"
    requests = [["math-image", "math", [IMAGE]], ["text", None, []]]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.managers.paged._keyed_process", redis_server.url, namespace],
        input=json.dumps(requests) + "\n", capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=child_env(PYTHONHASHSEED="4321"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    index = PrefixRouterIndex(page_size=4)
    assert theirs["math-image"] == index.page_hashes(PROMPT, None, "math", [MultimodalInput(*IMAGE)])
    assert theirs["text"] == index.page_hashes(PROMPT)
    m = make_paged(session, num_pages=16, max_seq_len=24,
                   tiers=(mokv.RemoteTierConfig(url=redis_server.url, namespace=namespace),))
    for rid, lora, images, expected in [
        ("same", "math", [IMAGE], 16),  # every page from the other process
        ("other-image", "math", [["img-b", 6, 6]], 4),
        ("other-adapter", "code", [IMAGE], 0),
        ("no-adapter", None, [IMAGE], 4),  # the text request's page 0 only
        ("text", None, [], 16),
    ]:
        assert found(m, keyed(rid, lora, images)) == expected, rid
    metrics = m.metrics  # every token found came from the other process's pages
    assert metrics.cache_tokens == metrics.remote_cache_tokens == 16 + 4 + 4 + 16
    m.close()
