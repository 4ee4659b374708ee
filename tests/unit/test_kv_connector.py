"""KV connector units: leases, the wire (TCP round trip with checksums, corruption, refusals),
block I/O over several cache groups, the scheduler side's load planning and the worker side."""

from __future__ import annotations

import socket
import struct
import time

import msgspec
import pytest
import torch

from tandem.core_protocol import FinishReason, KVTransferParams, SamplingParams
from tandem.engine_service.cache.block_pool import PagedGroup
from tandem.engine_service.cache.cache_spec import (
    CacheGroup,
    CacheLayout,
    FullAttentionSpec,
    LatentSpec,
    SlidingWindowSpec,
    StateSpec,
)
from tandem.engine_service.cache.cache_tensors import allocate_cache_tensors
from tandem.engine_service.config import KVTransferConfig
from tandem.engine_service.cache.block_manager import NULL_BLOCK, BlockManager
from tandem.engine_service.kv_connector.block_io import KVBlockIO
from tandem.engine_service.kv_connector.auth import KVCredentials, prompt_digest
from tandem.engine_service.kv_connector.leases import Lease, LeasedBlocks, LeaseTable
from tandem.engine_service.kv_connector.metadata import KVConnectorMetadata, LoadSpec
from tandem.engine_service.kv_connector.scheduler_side import KVConnectorScheduler, LoadRefused
from tandem.engine_service.kv_connector.state_io import StateSlotIO
from tandem.engine_service.kv_connector.tcp_transport import (
    MIN_PART_BYTES,
    PULL_STREAMS,
    KVPullServer,
    TransferError,
    connect,
    num_parts,
    pull,
    pull_blocks,
    pull_parts,
)
from tandem.engine_service.kv_connector.wire import (
    BlockFrame,
    PullEnd,
    PullError,
    PullRequest,
    ReleaseLease,
    StateFrame,
    WireError,
    checksum,
    frame_limit,
    recv_message,
    send_message,
)
from tandem.engine_service.kv_connector.worker_side import KVConnectorWorker
from tandem.engine_service.cache.memory_plan import GroupPlan, MemoryPlan
from tandem.engine_service.sequence import Sequence
from tandem.engine_service.step_plan import StepPlan, decode_plan, encode_plan

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- leases ---------------------------------------------------------------------------------------


def test_lease_expires_unless_pinned_and_releases_once():
    clock = Clock()
    table = LeaseTable(clock)
    a = table.grant("a", LeasedBlocks("a", [[1, 2]]), ttl_seconds=5)
    b = table.grant("b", LeasedBlocks("b", [[3]]), ttl_seconds=5)
    assert table.pin(a.lease_id) == [[1, 2]]
    clock.t += 6
    assert table.pin(b.lease_id) is None  # expired leases cannot be pinned
    gone = table.take_releasable()
    assert [lease.request_id for lease in gone] == ["b"]  # a is pinned: kept though expired
    table.unpin(a.lease_id, release=True)
    assert [lease.request_id for lease in table.take_releasable()] == ["a"]
    assert table.take_releasable() == [] and len(table) == 0
    assert (table.expired_total, table.released_total) == (1, 1)


def test_lease_released_by_prefill_request_id():
    table = LeaseTable(Clock())
    lease = table.grant("p", LeasedBlocks("p", [[4]]), ttl_seconds=30)
    assert not table.release_request_id("other")
    assert table.release_request_id("p")
    assert table.pin(lease.lease_id) is None  # released: no new pull starts
    assert [x.lease_id for x in table.take_releasable()] == [lease.lease_id]


# -- the wire -------------------------------------------------------------------------------------


class FakeBlocks:
    """read_blocks over a dict: block id -> bytes per group."""

    def __init__(self, groups: list[dict[int, bytes]]) -> None:
        self.groups = groups

    def __call__(self, group: int, ids: list[int]) -> list[bytes]:
        return [self.groups[group][i] for i in ids]


@pytest.fixture()
def server():
    table = LeaseTable()
    blocks = FakeBlocks([{i: bytes([i]) * 64 for i in range(8)}, {i: bytes([100 + i]) * 32 for i in range(8)}])
    srv = KVPullServer("127.0.0.1", 0, table, blocks).start()
    yield srv
    srv.close()


PROMPT = [5, 6, 7, 8, 9]
DIGEST = prompt_digest(PROMPT)


def _grant(table: LeaseTable, rid: str, blocks: LeasedBlocks, ttl: float) -> Lease:
    """A lease made for PROMPT."""
    return table.grant(rid, blocks, ttl, prompt_digest=DIGEST)


def _pull(srv: KVPullServer, lease: Lease, ids: list[list[int]], sizes=(64, 32), **auth):
    """Pull with the lease's secret and PROMPT's digest (or what `auth` says instead)."""
    auth = {"lease_secret": lease.secret, "prompt_digest": DIGEST, **auth}
    with connect(srv.host, srv.port, 5) as sock:
        sock.settimeout(5)
        return pull_blocks(sock, lease.lease_id, ids, list(sizes), **auth)


def _wait_released(table: LeaseTable, lease_id: str) -> None:
    deadline = time.monotonic() + 5
    while table.pin(lease_id) is not None:
        table.unpin(lease_id, release=False)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_tcp_round_trip_sends_the_named_blocks_and_releases_the_lease(server):
    lease = _grant(server.leases, "r", LeasedBlocks("r", [[1, 2, 5], [1, 2, 5]]), 30)
    got = _pull(server, lease, [[1, 5], [2]])
    assert got == [[bytes([1]) * 64, bytes([5]) * 64], [bytes([102]) * 32]]
    assert server.frames_sent == 3
    _wait_released(server.leases, lease.lease_id)
    assert len(server.leases.take_releasable()) == 1


def test_a_pull_in_parts_brings_every_block_and_releases_the_lease_after_the_last_part(server):
    lease = _grant(server.leases, "r", LeasedBlocks("r", [[1, 2, 3, 4, 5], [1, 2, 3]]), 30)
    auth = {"lease_secret": lease.secret, "prompt_digest": DIGEST}
    socks = [connect(server.host, server.port, 5) for _ in range(3)]
    try:
        for s in socks:
            s.settimeout(5)
        got = pull_parts(socks, lease.lease_id, [[1, 2, 3, 5], [2, 3]], [64, 32], **auth)
    finally:
        for s in socks:
            s.close()
    assert [[bytes(v) for v in g] for g in got.blocks] == [
        [bytes([i]) * 64 for i in (1, 2, 3, 5)], [bytes([100 + i]) * 32 for i in (2, 3)]]
    assert server.frames_sent == 6
    _wait_released(server.leases, lease.lease_id)
    # One part served in full does not release the lease while the other is still to come.
    lease = _grant(server.leases, "s", LeasedBlocks("s", [[1, 2], [1]]), 30)
    with connect(server.host, server.port, 5) as sock:
        sock.settimeout(5)
        got = pull(sock, lease.lease_id, [[1], []], [64, 32], part=0, parts=2, **auth | {"lease_secret": lease.secret})
    assert [bytes(v) for v in got.blocks[0]] == [bytes([1]) * 64]
    time.sleep(0.2)  # the producer has unpinned part 0
    assert server.leases.pin(lease.lease_id) is not None, "released before its last part"
    server.leases.unpin(lease.lease_id, release=False)
    with connect(server.host, server.port, 5) as sock:
        sock.settimeout(5)
        pull(sock, lease.lease_id, [[2], [1]], [64, 32], part=1, parts=2, **auth | {"lease_secret": lease.secret})
    _wait_released(server.leases, lease.lease_id)
    # A failed part fails the pull, naming its part, and releases the lease.
    lease = _grant(server.leases, "t", LeasedBlocks("t", [[1, 2, 3, 4], [1]]), 30)
    server.tamper = lambda data: bytes([data[0] ^ 1]) + data[1:] if data[0] == 4 else data
    socks = [connect(server.host, server.port, 5) for _ in range(2)]
    try:
        with pytest.raises(TransferError, match="part 1 of 2: checksum mismatch in block \\(group 0, index 1\\)"):
            pull_parts(socks, lease.lease_id, [[1, 2, 3, 4], [1]], [64, 32], lease_secret=lease.secret,
                       prompt_digest=DIGEST)
    finally:
        server.tamper = None
        for s in socks:
            s.close()
    _wait_released(server.leases, lease.lease_id)
    assert num_parts([[1] * 8], [MIN_PART_BYTES]) == PULL_STREAMS and num_parts([[1, 2]], [64]) == 1


def test_corrupted_frame_is_detected(server):
    lease = _grant(server.leases, "r", LeasedBlocks("r", [[1, 2], [1, 2]]), 30)
    server.tamper = lambda data: data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(TransferError, match="checksum mismatch in block \\(group 0, index 0\\)"):
        _pull(server, lease, [[1, 2], [1]])
    _wait_released(server.leases, lease.lease_id)  # a failed pull releases too


def test_wrong_block_size_and_unleased_blocks_and_unknown_leases_are_refused(server):
    lease = _grant(server.leases, "r", LeasedBlocks("r", [[1, 2], [1, 2]]), 30)
    with pytest.raises(TransferError, match="not in the lease"):
        _pull(server, lease, [[1, 3], []])
    with pytest.raises(TransferError, match="unknown, expired, released or not yours"):
        _pull(server, Lease("nope", "x", LeasedBlocks("x", [[1]]), 0.0), [[1], []])
    lease2 = _grant(server.leases, "s", LeasedBlocks("s", [[1], [1]]), 30)
    with pytest.raises(TransferError, match="has 64 bytes, expected 48"):
        _pull(server, lease2, [[1], []], sizes=(48, 32))


def test_missing_blocks_and_malformed_frames_are_errors():
    a, b = socket.socketpair()
    with a, b:
        # A producer that says "done" after one of two blocks.
        send_message(b, BlockFrame(group=0, index=0, nbytes=8, crc32=checksum(b"x" * 8)), b"x" * 8)
        send_message(b, PullEnd(num_frames=1))
        with pytest.raises(TransferError, match="after 1 of 2 blocks"):
            pull_blocks(a, "l", [[3, 4]], [8])
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        with pytest.raises(WireError, match="malformed"):
            recv_message(a)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 10) + b"abc")
        b.close()
        with pytest.raises(WireError, match="closed after 3 of 10"):
            recv_message(a)


def _state_server(state_bytes: int = 24):
    table = LeaseTable()
    blocks = FakeBlocks([{i: bytes([i]) * 64 for i in range(8)}])
    srv = KVPullServer("127.0.0.1", 0, table, blocks, read_state=lambda slot: bytes([200 + slot]) * state_bytes)
    return srv.start()


def _pull_state(srv: KVPullServer, lease: Lease, ids: list[list[int]], slot: int | None, state_bytes: int = 24):
    with connect(srv.host, srv.port, 5) as sock:
        sock.settimeout(5)
        return pull(sock, lease.lease_id, ids, [64], slot, state_bytes, lease_secret=lease.secret,
                    prompt_digest=DIGEST)


def test_tcp_pull_carries_the_lease_state_slot_after_the_blocks():
    srv = _state_server()
    try:
        lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1, 2]], state_slot=3), 30)
        got = _pull_state(srv, lease, [[2]], 3)
        assert got.blocks == [[bytes([2]) * 64]] and got.state == bytes([203]) * 24
        assert srv.frames_sent == 2  # the block, then the state
        _wait_released(srv.leases, lease.lease_id)
        # Without a state slot in the request, no state frame is sent.
        lease = _grant(srv.leases, "s", LeasedBlocks("s", [[1]], state_slot=0), 30)
        assert _pull_state(srv, lease, [[1]], None).state is None
        # A slot that is not the lease's is refused; a lease without a slot has none to give.
        lease = _grant(srv.leases, "t", LeasedBlocks("t", [[1]], state_slot=5), 30)
        with pytest.raises(TransferError, match="state slot 4 is not in the lease"):
            _pull_state(srv, lease, [[1]], 4)
        lease = _grant(srv.leases, "u", LeasedBlocks("u", [[1]]), 30)
        with pytest.raises(TransferError, match="state slot 0 is not in the lease"):
            _pull_state(srv, lease, [[1]], 0)
    finally:
        srv.close()


def test_corrupted_or_mis_sized_state_frames_are_detected():
    srv = _state_server()
    try:
        lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1]], state_slot=2), 30)
        srv.tamper_state = lambda data: bytes([data[0] ^ 1]) + data[1:]
        with pytest.raises(TransferError, match="checksum mismatch in the state of slot 2"):
            _pull_state(srv, lease, [[1]], 2)
        _wait_released(srv.leases, lease.lease_id)  # a failed pull releases too
        srv.tamper_state = None
        lease = _grant(srv.leases, "s", LeasedBlocks("s", [[1]], state_slot=2), 30)
        with pytest.raises(TransferError, match="state frame has 24 bytes, expected 32"):
            _pull_state(srv, lease, [[1]], 2, state_bytes=32)
    finally:
        srv.close()
    # A producer that ends without the requested state, or sends one nobody asked for.
    a, b = socket.socketpair()
    with a, b:
        send_message(b, PullEnd(num_frames=0))
        with pytest.raises(TransferError, match="after 0 of 1 frames \\(blocks and the state\\)"):
            pull(a, "l", [[]], [8], 1, 8)
    a, b = socket.socketpair()
    with a, b:
        send_message(b, StateFrame(slot=1, nbytes=8, crc32=checksum(b"x" * 8)), b"x" * 8)
        with pytest.raises(TransferError, match="state frame for slot 1, requested None"):
            pull(a, "l", [[]], [8])


# -- block I/O ------------------------------------------------------------------------------------


def _layout() -> CacheLayout:
    return CacheLayout((
        CacheGroup("full_attention", FullAttentionSpec(2, 8, "float32"), (0, 2)),
        CacheGroup("sliding_window_8", SlidingWindowSpec(2, 8, "float32", sliding_window=8), (1,)),
        CacheGroup("latent", LatentSpec(16, "bfloat16"), (3,)),
    ))


def _tensors(layout: CacheLayout, seed: int):
    groups = tuple(GroupPlan(g.name, g.spec, g.layer_ids, num_blocks=10, bytes_per_block=g.bytes_per_block(BS))
                   for g in layout.groups)
    plan = MemoryPlan(groups=groups, block_size=BS)
    tensors = allocate_cache_tensors(layout, plan, 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in [*(t for t in tensors.kv_caches if t is not None), *tensors.latent.values()]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return tensors


def test_block_io_round_trip_over_every_group_and_layer():
    layout = _layout()
    src, dst = _tensors(layout, 1), _tensors(layout, 2)
    a, b = KVBlockIO(layout, src), KVBlockIO(layout, dst)
    assert a.block_bytes == [2 * (2 * BS * 2 * 8 * 4), 2 * BS * 2 * 8 * 4, BS * 16 * 2]
    before = [t.clone() for t in [*(t for t in dst.kv_caches if t is not None), *dst.latent.values()]]
    for g in range(3):
        b.write_blocks(g, [7, 0], a.read_blocks(g, [3, 5]))
    for layer in (0, 1, 2):
        assert torch.equal(dst.kv_caches[layer][:, 7], src.kv_caches[layer][:, 3])
        assert torch.equal(dst.kv_caches[layer][:, 0], src.kv_caches[layer][:, 5])
    assert torch.equal(dst.latent[3][7], src.latent[3][3])
    # Nothing else was written.
    after = [t for t in [*(t for t in dst.kv_caches if t is not None), *dst.latent.values()]]
    for t0, t1 in zip(before, after):
        dim = 1 if t1.dim() == 5 else 0
        keep = [i for i in range(t1.shape[dim]) if i not in (0, 7)]
        assert torch.equal(t0.index_select(dim, torch.tensor(keep)), t1.index_select(dim, torch.tensor(keep)))
    # The device-copy path (CUDA IPC's) writes the same.
    c = KVBlockIO(layout, _tensors(layout, 3))
    for g in range(3):
        c.copy_blocks_from(g, [t for t, _ in a.layers[g]], [3, 5], [7, 0])
        assert c.read_blocks(g, [7, 0]) == a.read_blocks(g, [3, 5])
    # Ascending runs on one side or both are copied as views; the bytes are the same, and the
    # blocks outside the named ones are untouched.
    for remote_ids, local_ids in (([3, 4, 5], [1, 2, 3]), ([3, 4, 5], [7, 0, 2]), ([5, 1, 3], [4, 5, 6])):
        d = KVBlockIO(layout, _tensors(layout, 4))
        others = [b_ for b_ in range(8) if b_ not in local_ids]
        for g in range(3):
            before = d.read_blocks(g, others)
            d.copy_blocks_from(g, [t for t, _ in a.layers[g]], remote_ids, local_ids)
            assert d.read_blocks(g, local_ids) == a.read_blocks(g, remote_ids)
            assert d.read_blocks(g, others) == before
    with pytest.raises(ValueError, match="expected"):
        b.write_blocks(0, [1], [b"short"])


def _hybrid_layout() -> CacheLayout:
    return CacheLayout((
        CacheGroup("full_attention", FullAttentionSpec(2, 8, "float32"), (1,)),
        CacheGroup("linear_attention_state", StateSpec(((3, 5), (2, 4, 4)), ("float32", "bfloat16")), (0, 2)),
    ))


def _hybrid_tensors(layout: CacheLayout, seed: int, num_slots: int = 4, num_checkpoints: int = 2):
    groups = []
    for g in layout.groups:
        if g.paged:
            groups.append(GroupPlan(g.name, g.spec.kind, g.layer_ids, num_blocks=6,
                                    bytes_per_block=g.bytes_per_block(BS)))
        else:
            groups.append(GroupPlan(g.name, "state", g.layer_ids, num_slots=num_slots,
                                    bytes_per_slot=g.bytes_per_slot(), num_checkpoint_slots=num_checkpoints))
    tensors = allocate_cache_tensors(layout, MemoryPlan(groups=tuple(groups), block_size=BS), 3, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for layers in tensors.state.values():
        for ts in layers.values():
            for t in ts:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return tensors


def test_state_slot_io_moves_one_slot_of_every_state_layer_in_a_fixed_order():
    layout = _hybrid_layout()
    src, dst = _hybrid_tensors(layout, 1), _hybrid_tensors(layout, 2)
    a, b = StateSlotIO(layout, src, 4), StateSlotIO(layout, dst, 4)
    # Layer 0 (conv, recurrent), then layer 2 (conv, recurrent).
    assert [tuple(t.shape[1:]) for t in a.tensors] == [(3, 5), (2, 4, 4), (3, 5), (2, 4, 4)]
    assert a.slot_bytes == 2 * (15 * 4 + 32 * 2)
    data = a.read_slot(1)
    assert data[:60] == src.state["linear_attention_state"][0][0][1].numpy().tobytes()
    before = [t.clone() for t in b.tensors]
    b.write_slot(3, data)
    for t_src, t_dst, t0 in zip(a.tensors, b.tensors, before):
        assert torch.equal(t_dst[3], t_src[1])
        keep = [i for i in range(t_dst.shape[0]) if i != 3]
        assert torch.equal(t_dst[keep], t0[keep])  # checkpoint and scratch slots untouched
    # The device-copy path (CUDA IPC's) writes the same.
    c = StateSlotIO(layout, _hybrid_tensors(layout, 3), 4)
    c.copy_slot_from(a.tensors, 1, 0)
    assert c.read_slot(0) == data
    with pytest.raises(ValueError, match="expected 248"):
        b.write_slot(0, data[:-1])
    with pytest.raises(ValueError, match="outside the 4 request slots"):
        b.read_slot(4)  # a checkpoint slot never travels
    other = CacheLayout((layout.groups[0], CacheGroup("s", StateSpec(((3, 6),), ("float32",)), (0, 2))))
    with pytest.raises(ValueError, match="does not match"):
        StateSlotIO(other, _hybrid_tensors(other, 4), 4).copy_slot_from(a.tensors[:2], 0, 0)


def test_block_io_covers_the_paged_groups_of_a_hybrid_layout():
    layout = _hybrid_layout()
    io = KVBlockIO(layout, _hybrid_tensors(layout, 1))
    assert io.num_groups == 1 and io.block_bytes == [2 * BS * 2 * 8 * 4]


# -- scheduler side -------------------------------------------------------------------------------


def _bm(windows=(None,)) -> BlockManager:
    groups = [PagedGroup(f"g{i}", 32, w) for i, w in enumerate(windows)]
    return BlockManager(32, BS, groups=groups)


def _connector(bm: BlockManager, role="consumer") -> KVConnectorScheduler:
    return KVConnectorScheduler(KVTransferConfig(role=role, producers=["127.0.0.1:9"]), bm, "me", ("127.0.0.1", 1))


def _params(num_tokens: int, groups: list[list[int]], **kw) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_engine_id="prod", remote_host="127.0.0.1", remote_port=9,
                            remote_block_ids=groups[0], remote_group_block_ids=groups, num_prompt_tokens=num_tokens,
                            first_token_id=5, lease_id="L", lease_secret="S", block_size=BS, **kw)


def _seq(rid: str, tokens: list[int], params=None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), kv_transfer_params=params)


def test_admit_load_pulls_only_blocks_past_the_local_prefix_hit():
    bm = _bm()
    kv = _connector(bm)
    prompt = list(range(10, 33))  # 23 tokens: 6 blocks, the last one partial
    # A local request computed the first 2 blocks of the same prompt.
    local = _seq("local", prompt[:9])
    assert bm.allocate(local, 9)
    local.num_computed_tokens = 9
    bm.commit(local)
    bm.free(local)
    remote = [[100, 101, 102, 103, 104, 105]]
    seq = _seq("d", prompt + [7], _params(23, remote))
    assert kv.needs_load(seq)
    assert kv.admit_load(seq)
    assert seq.num_computed_tokens == 8  # the hit
    meta = kv.take_metadata()
    (spec,) = meta.start_loads
    assert spec.remote_block_ids == [[102, 103, 104, 105]]
    assert spec.local_block_ids == [seq.block_tables[0][2:6]] and len(seq.block_tables[0]) == 6
    assert spec.num_tokens == 23 and kv.take_metadata() is None
    # The plan carries it as msgpack.
    plan = decode_plan(encode_plan(StepPlan(step_id=0, kv_connector_metadata=meta)))
    assert plan.kv_connector_metadata == meta
    kv.load_finished(seq, spec.num_tokens)
    assert seq.num_computed_tokens == 23 and seq.remote_kv_done and not kv.needs_load(seq)
    assert kv.counters.remote_tokens_loaded == 15


def test_admit_load_skips_window_blocks_the_first_query_cannot_see():
    bm = _bm((None, 8))
    kv = _connector(bm)
    prompt = list(range(10, 33))  # 23 tokens; the query at 23 sees 16..23: blocks 4, 5
    remote = [[50, 51, 52, 53, 54, 55], [NULL_BLOCK, NULL_BLOCK, 62, 63, 64, 65]]
    seq = _seq("d", prompt + [7], _params(23, remote))
    assert kv.admit_load(seq)
    (spec,) = kv.take_metadata().start_loads
    assert spec.remote_block_ids == [[50, 51, 52, 53, 54, 55], [64, 65]]
    assert seq.block_tables[1][:4] == [NULL_BLOCK] * 4  # never held, never hashed
    assert bm.pools[1].num_free == 32 - 2


def test_admit_load_refuses_bad_parameters_and_leaves_nothing_allocated():
    bm = _bm()
    kv = _connector(bm)
    prompt = list(range(10, 20))
    cases = [
        (_params(9, [[1, 2, 3]]), None),
        (msgspec.structs.replace(_params(9, [[1, 2, 3]]), block_size=8), "block size 8"),
        (_params(10, [[1, 2, 3]]), "num_prompt_tokens=10"),
        (_params(9, [[1, 2]]), "name fewer"),
        (_params(9, [[1, 2, 3], [4, 5, 6]]), "2 cache groups"),
        (KVTransferParams(do_remote_prefill=True, remote_block_ids=[1]), "lacks remote_host, remote_port"),
    ]
    for params, error in cases:
        seq = _seq("d", prompt, params)
        if error is None:
            assert kv.admit_load(seq)
            bm.free(seq)
            kv.cancel_load("d")
            continue
        with pytest.raises(LoadRefused, match=error):
            kv.admit_load(seq)
        assert bm.num_free_blocks == 32
    # Every refused load releases its lease (four refusals that name a trusted producer and a
    # lease), and a load cancelled before its plan was sent does too.
    meta = kv.take_metadata()
    assert meta.start_loads == [] and meta.cancel_loads == []
    assert meta.release_leases == [("127.0.0.1", 9, "L", "S")] * 5
    assert kv.take_metadata() is None


def test_producer_leases_a_finished_prefill_and_sweep_frees_it():
    bm = _bm()
    kv = _connector(bm, role="producer")
    prompt = list(range(10, 20))
    seq = _seq("p", prompt, KVTransferParams(do_remote_decode=True))
    assert bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    seq.append_token(42)
    seq.finish(FinishReason.LENGTH)
    tables = [list(t) for t in seq.block_tables]
    kv.on_request_finished(seq)
    kv.on_request_finished(seq)  # idempotent
    p = seq.kv_transfer_params
    assert p.do_remote_prefill and p.remote_block_ids == tables[0] and p.num_prompt_tokens == 10
    assert p.first_token_id == 42 and p.block_size == BS and (p.remote_host, p.remote_port) == ("127.0.0.1", 1)
    assert seq.block_tables == [[]] and len(kv.leases) == 1
    bm.free(seq)  # what the scheduler does at finish: the lease's blocks stay held
    assert bm.num_free_blocks == 32 - 3
    assert bm.num_cached_blocks == 2  # the two full blocks joined the prefix cache
    assert kv.sweep() == 0
    assert kv.release_request("p") and kv.sweep() == 1
    assert bm.num_free_blocks == 32
    # A stop at the first token (or any other ending) keeps nothing.
    other = _seq("q", prompt, KVTransferParams(do_remote_decode=True))
    other.append_token(2)
    other.finish(FinishReason.STOP)
    kv.on_request_finished(other)
    assert other.kv_transfer_params.lease_id is None and len(kv.leases) == 0


def _hybrid_bm() -> BlockManager:
    # 4 request slots, 2 checkpoint slots, a checkpoint every two blocks.
    return BlockManager(32, BS, groups=[PagedGroup("g0", 32, None)], num_state_slots=4, num_checkpoint_slots=2,
                        checkpoint_stride=2 * BS)


def test_hybrid_admit_load_takes_a_slot_hits_kv_alone_and_restores_or_saves_no_checkpoint():
    bm = _hybrid_bm()
    kv = _connector(bm)
    prompt = list(range(10, 33))  # 23 tokens
    # A local request computed the first 3 blocks: a checkpoint at 8 (the stride), K/V to 12.
    local = _seq("local", prompt[:13])
    assert bm.allocate(local, 8)  # a chunk ending on the checkpoint position saves the state there
    local.num_computed_tokens = 8
    bm.commit(local)
    assert bm.allocate(local, 5)
    local.num_computed_tokens = 13
    bm.commit(local)
    bm.pop_state_copies()
    bm.free(local)
    assert bm.checkpoints.num_registered == 1
    seq = _seq("d", prompt + [7], _params(23, [[100, 101, 102, 103, 104, 105]], remote_state_slot=2))
    assert bm.match_prefix(seq) == 8  # a local admission would restore the checkpoint at 8
    assert kv.admit_load(seq)
    assert seq.num_computed_tokens == 12  # the K/V hit: the pulled state covers all 23 tokens
    assert seq.state_slot is not None and bm.state_slots.num_used == 1
    assert bm.pop_state_copies() == ([], [])  # no restore over the pulled state, no save of an empty slot
    assert bm.checkpoints.num_restored == 0 and bm.checkpoints.num_pending == 0
    (spec,) = kv.take_metadata().start_loads
    assert spec.remote_block_ids == [[103, 104, 105]]
    assert (spec.remote_state_slot, spec.local_state_slot) == (2, seq.state_slot)
    bm.free(seq)
    assert bm.state_slots.num_used == 0


def test_hybrid_admit_load_refuses_parameters_without_a_state_slot():
    bm = _hybrid_bm()
    kv = _connector(bm)
    seq = _seq("d", list(range(10, 20)), _params(9, [[1, 2, 3]]))
    with pytest.raises(LoadRefused, match="lacks remote_state_slot"):
        kv.admit_load(seq)
    assert bm.state_slots.num_used == 0 and bm.num_free_blocks == 32
    # NIXL moves blocks only: a load with state goes over TCP.
    kv = KVConnectorScheduler(KVTransferConfig(role="consumer", producers=["127.0.0.1:*"]), bm, "me", None,
                              local_transports=("tcp", "nixl"))
    seq = _seq("e", list(range(10, 20)), _params(9, [[1, 2, 3]], remote_state_slot=0, remote_transport="nixl"))
    assert kv.admit_load(seq)
    (spec,) = kv.take_metadata().start_loads
    assert spec.transport == "tcp" and spec.remote_state_slot == 0
    bm.free(seq)


def test_hybrid_producer_leases_the_slot_only_after_exactly_the_prompt():
    bm = _hybrid_bm()
    kv = _connector(bm, role="producer")
    prompt = list(range(10, 20))
    seq = _seq("p", prompt, KVTransferParams(do_remote_decode=True))
    assert bm.allocate(seq, 10)
    slot = seq.state_slot
    seq.num_computed_tokens = 10
    seq.append_token(42)
    seq.finish(FinishReason.LENGTH)
    kv.on_request_finished(seq)
    assert seq.kv_transfer_params.remote_state_slot == slot and seq.state_slot is None
    bm.free(seq)
    assert bm.state_slots.num_used == 1  # held by the lease
    assert kv.release_request("p") and kv.sweep() == 1
    assert bm.state_slots.num_used == 0
    # A leg that fed its first generated token through the model: its state is past the prompt.
    fed = _seq("f", prompt, KVTransferParams(do_remote_decode=True))
    assert bm.allocate(fed, 10)
    fed.num_computed_tokens = 10
    fed.append_token(42)
    assert bm.allocate(fed, 1)
    fed.num_computed_tokens = 11
    fed.append_token(43)
    fed.finish(FinishReason.LENGTH)
    kv.on_request_finished(fed)
    assert fed.kv_transfer_params.lease_id is None and len(kv.leases) == 0 and fed.state_slot is not None
    bm.free(fed)
    assert bm.state_slots.num_used == 0


# -- worker side ----------------------------------------------------------------------------------


def test_worker_pulls_writes_and_drops_cancelled_loads():
    layout = CacheLayout((CacheGroup("full_attention", FullAttentionSpec(2, 8, "float32"), (0, 1)),))
    src, dst = _tensors(layout, 1), _tensors(layout, 2)
    src_io, dst_io = KVBlockIO(layout, src), KVBlockIO(layout, dst)
    table = LeaseTable()
    srv = KVPullServer("127.0.0.1", 0, table, src_io.read_blocks).start()
    worker = KVConnectorWorker(dst_io)
    try:
        lease = _grant(table, "p", LeasedBlocks("p", [[2, 4, 6]]), 30)
        spec = LoadSpec(request_id="d", remote_engine_id="prod", remote_host=srv.host, remote_port=srv.port,
                        lease_id=lease.lease_id, transport="tcp", remote_block_ids=[[4, 6]],
                        local_block_ids=[[8, 9]], num_tokens=12, lease_secret=lease.secret, prompt_digest=DIGEST)
        worker.apply(KVConnectorMetadata(start_loads=[spec]))
        assert worker.num_loading == 1
        assert worker.wait(10)
        report = worker.poll()
        assert report.finished == ["d"] and report.blocks_loaded == 2
        assert report.bytes_loaded == 2 * dst_io.block_bytes[0]
        assert dst_io.read_blocks(0, [8, 9]) == src_io.read_blocks(0, [4, 6])
        # A load cancelled before it completes is never written, and its lease is released.
        lease2 = _grant(table, "p2", LeasedBlocks("p2", [[1]]), 30)
        before = dst_io.read_blocks(0, [3])
        spec2 = LoadSpec(request_id="e", remote_engine_id="prod", remote_host=srv.host, remote_port=srv.port,
                         lease_id=lease2.lease_id, transport="tcp", remote_block_ids=[[1]], local_block_ids=[[3]],
                         num_tokens=4, lease_secret=lease2.secret, prompt_digest=DIGEST)
        worker.apply(KVConnectorMetadata(start_loads=[spec2]))
        worker.apply(KVConnectorMetadata(cancel_loads=["e"]))
        assert worker.num_loading == 0
        time.sleep(0.2)
        assert not worker.poll()
        assert dst_io.read_blocks(0, [3]) == before
        # A lease named for release (its load was cancelled before it started) is released.
        lease3 = _grant(table, "p3", LeasedBlocks("p3", [[5]]), 30)
        worker.apply(KVConnectorMetadata(release_leases=[(srv.host, srv.port, lease3.lease_id, lease3.secret)]))
        deadline = time.monotonic() + 5
        while lease3.lease_id not in {x.lease_id for x in table.take_releasable()}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # A failed load is reported with why.
        spec3 = LoadSpec(request_id="f", remote_engine_id="prod", remote_host=srv.host, remote_port=srv.port,
                         lease_id="gone", transport="tcp", remote_block_ids=[[1]], local_block_ids=[[3]], num_tokens=4)
        worker.apply(KVConnectorMetadata(start_loads=[spec3]))
        assert worker.wait(10)
        report = worker.poll()
        assert "unknown, expired, released or not yours" in report.failed["f"]
        assert report.refused == ["f"]  # the parameters were wrong, not the producer
    finally:
        worker.close()
        srv.close()


# -- tandem bench disagg: the two shapes' arguments --------------------------------------------------


def test_bench_disagg_shape_arguments():
    from tandem.bench.disagg import shape_args

    flags = ["--model", "m", "--num-kv-blocks", "100", "--kv-role", "none", "--kv-transport", "cuda_ipc"]
    single = shape_args("single", flags, 100, None)
    assert single == ["--model", "m", "--kv-transport", "cuda_ipc", "--num-kv-blocks", "200"]
    assert shape_args("single", flags, 100, 150)[-2:] == ["--num-kv-blocks", "150"]
    disagg = shape_args("disaggregated", flags, 100, None)
    assert disagg[:6] == ["--model", "m", "--num-kv-blocks", "100", "--kv-transport", "cuda_ipc"]
    assert disagg[6:8] == ["--disaggregated", "--decode-engine-port"] and int(disagg[8]) > 0
    assert "--kv-role" not in disagg  # serve --disaggregated gives each engine its role
    with pytest.raises(ValueError, match="unknown shape"):
        shape_args("triple", flags, 100, None)


# -- NIXL: where each block's chunks lie (pure arithmetic, no NIXL needed) --------------------------


def test_nixl_descriptors_point_at_each_blocks_k_and_v_chunks():
    from tandem.engine_service.kv_connector.nixl_transport import chunk_descriptors, layer_regions

    layout = _layout()
    tensors = _tensors(layout, 4)
    io = KVBlockIO(layout, tensors)
    regions = layer_regions(io)
    ids = [3, 0, 9]
    for g, layers in enumerate(io.layers):
        rows = chunk_descriptors(regions[g], ids, 7)
        expected = []
        for t, dim in layers:  # (layer, chunk, block) order
            chunks = [t[c] for c in range(2)] if dim == 1 else [t]
            for chunk in chunks:
                for b in ids:
                    part = chunk[b]
                    assert part.is_contiguous()
                    expected.append((part.data_ptr(), part.numel() * part.element_size(), 7))
        assert [tuple(int(x) for x in r) for r in rows] == expected


def test_nixl_transport_pulls_between_two_engines():
    """Both engines on CPU with NIXL (UCX over the host); runs where nixl-cu13 is installed
    (`pip install 'tandem-serve[nixl]'`)."""
    pytest.importorskip("nixl_cu13")
    from tests.integration.test_kv_transfer import (
        assert_all_free, decode_leg, make_core, prefill_leg, prompt, request, run)

    ref, producer, consumer = make_core("none"), make_core("producer", transport="nixl"), make_core("consumer")
    try:
        assert "nixl" in consumer.engine.kv.transports
        prompts = {f"n{i}": prompt(70 + i, n) for i, n in enumerate([9, 26, 40])}
        expected = run(ref, [request(rid, t, 5) for rid, t in prompts.items()])
        legs = prefill_leg(producer, prompts)
        assert {leg.final.kv_transfer_params.remote_transport for leg in legs.values()} == {"nixl"}
        decoded = decode_leg(consumer, prompts, legs, 5)
        for rid in prompts:
            assert legs[rid].tokens + decoded[rid].tokens == expected[rid].tokens
        assert consumer.engine.stats().kv_remote_blocks_pulled == sum(-(-len(t) // 4) for t in prompts.values())
        assert producer.engine.kv.server.frames_sent == 0  # NIXL READs, no frames
        assert_all_free(producer, consumer)
    finally:
        for core in (ref, producer, consumer):
            core.engine.close()


# -- issue 19: who may pull, what a lease is bound to, bounded frames, statuses ---------------------


def _token_server(tokens=("engine-token",), tls: KVCredentials | None = None):
    table = LeaseTable()
    blocks = FakeBlocks([{i: bytes([i]) * 64 for i in range(8)}, {i: bytes([100 + i]) * 32 for i in range(8)}])
    creds = tls if tls is not None else KVCredentials(tokens=tokens)
    return KVPullServer("127.0.0.1", 0, table, blocks, credentials=creds).start()


def _pinnable(table: LeaseTable, lease: Lease) -> bool:
    """Whether the lease is still live (neither released nor expired)."""
    if table.pin(lease.lease_id) is None:
        return False
    table.unpin(lease.lease_id, release=False)
    return True


def _release(srv: KVPullServer, lease_id: str, **fields) -> object:
    with connect(srv.host, srv.port, 5) as sock:
        sock.settimeout(5)
        send_message(sock, ReleaseLease(lease_id=lease_id, **fields))
        return recv_message(sock)


def test_pull_port_needs_the_engine_token_and_the_lease_secret():
    """Item 1: a raw client without the engine's token, or without the lease's secret, neither
    pulls nor releases; with both it pulls."""
    srv = _token_server()
    try:
        lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1, 2], [1, 2]]), 30)
        with pytest.raises(TransferError, match="bearer token") as err:
            _pull(srv, lease, [[1], [1]])  # the secret, but no token
        assert err.value.kind == "unavailable"  # a misconfigured engine, not the caller's parameters
        with pytest.raises(TransferError, match="not yours") as err:
            _pull(srv, lease, [[1], [1]], token="engine-token", lease_secret="guessed")
        assert err.value.kind == "refused"
        assert isinstance(_release(srv, lease.lease_id), PullError)  # no token, no secret
        assert isinstance(_release(srv, lease.lease_id, token="engine-token"), PullError)  # no secret
        assert isinstance(_release(srv, lease.lease_id, token="wrong", lease_secret=lease.secret), PullError)
        assert _pinnable(srv.leases, lease) and srv.frames_sent == 0
        got = _pull(srv, lease, [[1, 2], [2]], token="engine-token")
        assert got == [[bytes([1]) * 64, bytes([2]) * 64], [bytes([102]) * 32]]
        other = _grant(srv.leases, "s", LeasedBlocks("s", [[3], [3]]), 30)
        assert isinstance(_release(srv, other.lease_id, token="engine-token", lease_secret=other.secret), PullEnd)
        _wait_released(srv.leases, other.lease_id)
    finally:
        srv.close()


def _write_pki(tmp_path):
    """A CA and a certificate for 127.0.0.1 signed by it (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv test ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "engine")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {}
    for name, data in (("ca", ca.public_bytes(serialization.Encoding.PEM)),
                       ("cert", cert.public_bytes(serialization.Encoding.PEM)),
                       ("key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_bytes(data)
    return {k: str(v) for k, v in paths.items()}


def test_pull_over_mutual_tls_with_the_engine_certificates(tmp_path):
    """Item 1: with TLS on the engine the pull port speaks TLS only and, with a client CA,
    requires a client certificate; a consumer with the engine's certificates pulls."""
    pki = _write_pki(tmp_path)
    creds = KVCredentials(tokens=("tok",), tls_cert=pki["cert"], tls_key=pki["key"], tls_client_ca=pki["ca"])
    srv = _token_server(tls=creds)
    try:
        lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1], [1]]), 30)
        with pytest.raises((TransferError, WireError, OSError)):
            _pull(srv, lease, [[1], [1]], token="tok")  # plaintext: the handshake fails
        no_cert = KVCredentials(tls_cert=None)
        assert no_cert.client_context() is None
        import ssl

        anonymous = ssl.create_default_context(cafile=pki["ca"])  # verifies the server, no client cert
        with pytest.raises((TransferError, WireError, OSError)):
            with connect(srv.host, srv.port, 5, anonymous) as sock:
                sock.settimeout(5)
                pull_blocks(sock, lease.lease_id, [[1], [1]], [64, 32], token="tok", lease_secret=lease.secret,
                            prompt_digest=DIGEST)
        assert _pinnable(srv.leases, lease) and srv.frames_sent == 0
        with connect(srv.host, srv.port, 5, creds.client_context()) as sock:
            sock.settimeout(5)
            assert sock.version() is not None  # TLS
            got = pull_blocks(sock, lease.lease_id, [[1], [1]], [64, 32], token="tok", lease_secret=lease.secret,
                              prompt_digest=DIGEST)
        assert got == [[bytes([1]) * 64], [bytes([101]) * 32]]
    finally:
        srv.close()


def test_a_client_named_producer_address_causes_no_connection():
    """Item 2: parameters naming an address the consumer was not configured with are refused
    before any connection, and no release goes there either."""
    bait = socket.create_server(("127.0.0.1", 0))
    bait.settimeout(0.3)
    port = bait.getsockname()[1]
    try:
        bm = _bm()
        kv = KVConnectorScheduler(KVTransferConfig(role="consumer", producers=["127.0.0.1:9"]), bm, "me", None)
        seq = _seq("d", list(range(10, 20)), msgspec.structs.replace(_params(9, [[1, 2, 3]]), remote_port=port))
        with pytest.raises(LoadRefused, match="does not trust"):
            kv.admit_load(seq)
        assert bm.num_free_blocks == 32 and kv.take_metadata() is None  # nothing to pull, nothing to release
        with pytest.raises((TimeoutError, socket.timeout)):
            bait.accept()
        # Its own pull address (--kv-role both) and a configured one are trusted.
        cfg = KVTransferConfig(role="both", producers=["10.0.0.2:6000", "127.0.0.2:*"])
        assert cfg.trusts_producer("127.0.0.1", 5, own=("127.0.0.1", 5))
        assert cfg.trusts_producer("10.0.0.2", 6000) and cfg.trusts_producer("127.0.0.2", 1)
        assert not cfg.trusts_producer("10.0.0.2", 6001) and not cfg.trusts_producer("127.0.0.1", 5)
        with pytest.raises(ValueError, match="host:port or host:\\*"):
            KVTransferConfig(role="consumer", producers=["10.0.0.2"])
    finally:
        bait.close()


def test_a_peer_frame_length_never_sizes_an_allocation_past_the_limit():
    """Item 3: a frame announcing 1 GiB is refused from its 4-byte header, with nothing
    allocated for it, on the consumer's side and on the producer's."""
    import tracemalloc

    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 1 << 30) + b"x" * 1024)
        tracemalloc.start()
        try:
            with pytest.raises(TransferError, match="exceeds the limit"):
                pull_blocks(a, "l", [[1]], [64])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
    a, b = socket.socketpair()
    with a, b:  # a frame within MAX_FRAME_BYTES but past this pull's blocks
        b.sendall(struct.pack(">I", 64 + 4097))
        with pytest.raises(WireError, match="exceeds the limit of 4160"):
            recv_message(a, frame_limit(64))
    srv = _token_server(tokens=())
    try:
        with connect(srv.host, srv.port, 5) as sock:
            sock.settimeout(5)
            sock.sendall(struct.pack(">I", 1 << 30))
            assert sock.recv(1) == b""  # the producer hangs up instead of reading a GiB
    finally:
        srv.close()


def test_a_lease_serves_only_its_own_prompt_and_its_blocks_once_in_order():
    """Item 4: another prompt's digest, a block named twice or out of order are refused, and the
    lease is released (its holder presented the secret and gave up on it)."""
    srv = _token_server(tokens=())
    try:
        for ids, digest, why in (([[1, 2], []], prompt_digest([1, 2, 3]), "another prompt"),
                                 ([[1, 1], []], DIGEST, "named twice"),
                                 ([[2, 1], []], DIGEST, "out of the lease's order")):
            lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1, 2], [1, 2]]), 30)
            with pytest.raises(TransferError, match=why) as err:
                _pull(srv, lease, ids, prompt_digest=digest)
            assert err.value.kind == "refused"
            _wait_released(srv.leases, lease.lease_id)
        assert srv.frames_sent == 0
    finally:
        srv.close()
    # The consumer refuses duplicated block ids in the parameters before any pull.
    bm = _bm()
    kv = _connector(bm)
    with pytest.raises(LoadRefused, match="twice"):
        kv.admit_load(_seq("d", list(range(10, 20)), _params(9, [[4, 4, 5]])))
    assert bm.num_free_blocks == 32
    # The load presents the digest of this engine's own prompt (its first num_prompt_tokens).
    prompt = list(range(10, 20))
    seq = _seq("e", prompt, _params(9, [[1, 2, 3]]))
    assert kv.admit_load(seq)
    spec = [s for s in kv.take_metadata().start_loads if s.request_id == "e"][0]
    assert spec.prompt_digest == prompt_digest(prompt[:9]) and spec.lease_secret == "S"


def test_refused_and_failed_loads_end_with_statuses_that_say_what_to_do():
    """Items 7 and 8: a refusal (e.g. num_prompt_tokens or block_size mismatch) is
    INVALID_ARGUMENT and releases its lease; an unreachable producer is UNAVAILABLE."""
    import grpc

    from tandem.core_protocol import RequestOutput, SchedulerReason, SchedulerStop
    from tandem.engine_service.api.server import error_status
    from tandem.engine_service.kv_connector.metadata import KVLoadReport
    from tandem.engine_service.kv_connector.scheduler_side import _failure_reason

    bm = _bm()
    kv = _connector(bm)
    for params in (_params(10, [[1, 2, 3]]), msgspec.structs.replace(_params(9, [[1, 2, 3]]), block_size=8)):
        with pytest.raises(LoadRefused):
            kv.admit_load(_seq("d", list(range(10, 20)), params))
        assert kv.take_metadata().release_leases == [("127.0.0.1", 9, "L", "S")]

    def status(reason):
        return error_status(RequestOutput("r", finished=True, stop_reason=SchedulerStop(reason, "x")))

    assert status(SchedulerReason.KV_TRANSFER_REFUSED) == grpc.StatusCode.INVALID_ARGUMENT
    assert status(SchedulerReason.KV_PRODUCER_UNAVAILABLE) == grpc.StatusCode.UNAVAILABLE
    assert status(SchedulerReason.KV_TRANSFER_FAILED) == grpc.StatusCode.INTERNAL
    report = KVLoadReport(failed={"a": "x", "b": "y", "c": "z"}, refused=["a"], write_failed=["c"])
    assert [_failure_reason(report, r) for r in "abc"] == [SchedulerReason.KV_TRANSFER_REFUSED,
                                                           SchedulerReason.KV_PRODUCER_UNAVAILABLE,
                                                           SchedulerReason.KV_TRANSFER_FAILED]


def _load_spec(rid: str, host: str, port: int, lease: Lease, remote, local, num_tokens: int) -> LoadSpec:
    return LoadSpec(request_id=rid, remote_engine_id="prod", remote_host=host, remote_port=port,
                    lease_id=lease.lease_id, transport="tcp", remote_block_ids=remote, local_block_ids=local,
                    num_tokens=num_tokens, lease_secret=lease.secret, prompt_digest=DIGEST)


def test_a_killed_producer_fails_the_load_as_unavailable():
    """Item 8: a producer that is gone, or dies mid-pull, fails the load as not refused
    (UNAVAILABLE), never as the caller's fault."""
    layout = CacheLayout((CacheGroup("full_attention", FullAttentionSpec(2, 8, "float32"), (0, 1)),))
    dst_io = KVBlockIO(layout, _tensors(layout, 2))
    worker = KVConnectorWorker(dst_io, timeout_s=5)
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there any more
    dying = socket.create_server(("127.0.0.1", 0))
    lease = Lease("L", "p", LeasedBlocks("p", [[1, 2]]), 0.0)
    try:
        worker.apply(KVConnectorMetadata(start_loads=[_load_spec("gone", "127.0.0.1", dead_port, lease, [[1]],
                                                                 [[3]], 4)]))
        assert worker.wait(10)
        report = worker.poll()
        assert "cannot reach the KV producer" in report.failed["gone"] and report.refused == []
        worker.apply(KVConnectorMetadata(start_loads=[_load_spec("mid", "127.0.0.1", dying.getsockname()[1], lease,
                                                                 [[1, 2]], [[3, 4]], 8)]))
        conn, _ = dying.accept()
        with conn:
            conn.settimeout(5)
            recv_message(conn)  # the pull request
            data = b"z" * dst_io.block_bytes[0]
            send_message(conn, BlockFrame(group=0, index=0, nbytes=len(data), crc32=checksum(data)), data)
        # ... and the producer process dies before the second block.
        assert worker.wait(10)
        report = worker.poll()
        assert "connection" in report.failed["mid"] and report.refused == []
    finally:
        dying.close()
        worker.close()


def test_a_consumer_killed_mid_pull_releases_the_lease_on_the_producer():
    """R9: the consumer's connection ends after the first frame: the lease is unpinned and
    released (the producer never waits for expiry)."""
    srv = _token_server(tokens=())
    try:
        lease = _grant(srv.leases, "r", LeasedBlocks("r", [[1, 2, 3, 4], [1, 2, 3, 4]]), 30)
        sock = connect(srv.host, srv.port, 5)
        sock.settimeout(5)
        send_message(sock, PullRequest(lease_id=lease.lease_id, block_ids=[[1, 2, 3, 4], [1, 2, 3, 4]],
                                       lease_secret=lease.secret, prompt_digest=DIGEST))
        assert isinstance(recv_message(sock), BlockFrame)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, as when the process dies
        _wait_released(srv.leases, lease.lease_id)
        assert [x.lease_id for x in srv.leases.take_releasable()] == [lease.lease_id]
    finally:
        srv.close()


def test_leases_are_capped_in_total_and_per_caller():
    """Issue 19: a producer refuses a prefill leg (kv_leases_exhausted) past `max_leases` in all
    or `max_leases_per_caller` for its caller, counting live leases and admitted legs; a leg that
    ends without a lease, and a released lease, make room again."""
    from tandem.core_protocol import SchedulerReason

    bm = _bm()
    kv = KVConnectorScheduler(KVTransferConfig(role="producer", max_leases=3, max_leases_per_caller=2), bm, "me",
                              ("127.0.0.1", 1))

    def leg(rid: str) -> Sequence:
        return _seq(rid, list(range(10, 18)), KVTransferParams(do_remote_decode=True))

    assert kv.reserve_lease(_seq("plain", [1, 2]), "a") is None  # not a prefill leg: never capped
    a1, a2, a3, b1, b2 = (leg(r) for r in ("a1", "a2", "a3", "b1", "b2"))
    assert kv.reserve_lease(a1, "a") is None and kv.reserve_lease(a2, "a") is None
    refused = kv.reserve_lease(a3, "a")
    assert refused.reason == SchedulerReason.KV_LEASES_EXHAUSTED and "caller" in refused.detail
    assert kv.reserve_lease(b1, "b") is None
    refused = kv.reserve_lease(b2, "b")
    assert refused.reason == SchedulerReason.KV_LEASES_EXHAUSTED and "(3)" in refused.detail
    # a1 makes its lease (still counted); a2 ends without one (room again).
    assert bm.allocate(a1, 8)
    a1.num_computed_tokens = 8
    a1.append_token(5)
    a1.finish(FinishReason.LENGTH)
    kv.on_request_finished(a1)
    assert a1.kv_lease_id is not None and kv.leases.count_for("a") == 1
    a2.finish(FinishReason.ABORT)
    kv.on_request_finished(a2)
    assert kv.reserve_lease(b2, "b") is None  # 3 again: a1's lease, b1, b2
    assert kv.reserve_lease(a3, "a").reason == SchedulerReason.KV_LEASES_EXHAUSTED
    assert kv.release_request("a1") and kv.sweep() == 1
    assert kv.reserve_lease(a3, "a") is None


def test_a_prefill_leg_past_the_lease_cap_ends_resource_exhausted_and_holds_nothing():
    import dataclasses

    import grpc

    from tandem.core_protocol import CoreRequest, SchedulerReason, SchedulerStop
    from tandem.engine_service.api.server import error_status
    from tests.integration.test_kv_transfer import config, greedy, prompt, run
    from tandem.engine_service.core.engine import LLMEngine
    from tandem.engine_service.core.engine_core import EngineCore

    cfg = config("producer")
    cfg = dataclasses.replace(cfg, kv_transfer=dataclasses.replace(cfg.kv_transfer, max_leases=1))
    core = EngineCore(LLMEngine(cfg))
    try:
        reqs = [CoreRequest(request_id=f"p{i}", prompt_token_ids=prompt(i, 9), sampling=greedy(1),
                            arrival_time=time.monotonic(), kv_transfer_params=KVTransferParams(do_remote_decode=True),
                            caller="router") for i in range(2)]
        out = run(core, reqs)
        assert out["p0"].final.kv_transfer_params.lease_id
        refused = out["p1"].final
        assert refused.finish_reason == FinishReason.ERROR and out["p1"].tokens == []
        assert refused.stop_reason.reason == SchedulerReason.KV_LEASES_EXHAUSTED
        assert isinstance(refused.stop_reason, SchedulerStop)
        assert error_status(refused) == grpc.StatusCode.RESOURCE_EXHAUSTED
        st = core.engine.stats()
        assert st.kv_leases_active == 1 and st.num_waiting == 0 and st.num_running == 0
    finally:
        core.engine.close()
