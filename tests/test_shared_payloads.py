"""Snapshot payloads in shared memory: a buddy maps the owner's bytes, never writes them, keeps
them when the owner lets them go, and finds nothing where there is no owner to ask."""

from __future__ import annotations

import gc

import torch

from megatron_elaswave.runtime.shared_payloads import SharedHandle, SharedPayloads


def test_a_buddy_maps_the_owners_bytes_and_its_writes_stay_its_own():
    owner, buddy = SharedPayloads(), SharedPayloads()
    payload = owner.allocate(1 << 16)
    payload.copy_(torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8))
    mapped = buddy.attach(owner.handle(payload), payload.numel())
    assert torch.equal(mapped, payload)
    mapped[:8] = 255
    assert payload[:8].tolist() == list(range(8))
    payload[1 << 15] = 7  # the owner's next snapshot there (a page the buddy did not write)
    assert mapped[1 << 15] == 7
    assert buddy.attach(owner.handle(payload), payload.numel()) is mapped  # asked once


def test_the_mapping_outlives_the_owners_buffer():
    owner, buddy = SharedPayloads(), SharedPayloads()
    payload = owner.allocate(4096)
    payload.fill_(42)
    handle = owner.handle(payload)
    mapped = buddy.attach(handle, 4096)
    del payload
    gc.collect()
    assert owner.handle(mapped) is None and bool((mapped == 42).all())
    assert SharedPayloads().attach(handle, 4096) is None  # no longer served


def test_nothing_is_mapped_without_an_owner_to_ask_or_of_another_size():
    owner = SharedPayloads()
    payload = owner.allocate(4096)
    assert SharedPayloads().attach(SharedHandle(b"\0elaswave-snapshots-nobody", 0), 4096) is None
    assert SharedPayloads().attach(owner.handle(payload), 1024) is None
    assert owner.handle(torch.empty(4096, dtype=torch.uint8)) is None
    assert owner.allocate(0) is None
