"""Codec properties: round trips, garbage input, forgery, replay, staleness."""

from __future__ import annotations

import msgspec

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.identity import Identity, peer_id_from_public_bytes, public_bytes_from_peer_id
from fedswarm.core.node import Guard
from fedswarm.core.wire import (
    KINDS,
    MAX_MESSAGE_BYTES,
    Award,
    AwardDecline,
    Bid,
    CallForBids,
    Cancel,
    Device,
    Gossip,
    JobSpec,
    LeaseAck,
    LeaseAckBatch,
    LeaseRenew,
    LeaseRenewBatch,
    PeerState,
    PowerInfo,
    ShardCheckpoint,
    SlotOffer,
    ShardResult,
    Span,
    VerifyCache,
    decode,
    encode,
    pack_params,
)
from fedswarm.errors import LocalProtocolError, RemoteProtocolError

ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))

names = st.text(min_size=1, max_size=20)
pos = st.floats(min_value=0, max_value=1e6, allow_nan=False)
small = st.integers(min_value=0, max_value=1000)

peer_states = st.builds(
    PeerState,
    seq=st.integers(0, 2**40),
    ttl_s=st.floats(0.1, 1000),
    devices=st.lists(st.builds(Device, st.sampled_from(["cpu", "cuda"]), names, small, small, small), max_size=3).map(tuple),
    slots=st.integers(0, 64),
    throughput=st.dictionaries(names, pos, max_size=4),
    backlog_s=pos,
    power=st.builds(PowerInfo, pos, pos, pos, pos, st.floats(0.5, 5), st.lists(st.floats(0.01, 1), min_size=1, max_size=5).map(tuple)),
    energy_price=pos,
    carbon_g_kwh=st.floats(0, 1e4),
    spans=st.lists(st.builds(lambda m, a, n, t: Span(m, a, a + n, t), names, small, st.integers(1, 10), pos), max_size=2).map(tuple),
    trust=st.sampled_from(["volunteer", "datacenter"]),
    membership=st.binary(max_size=64),
    addrs=st.lists(names, max_size=3).map(tuple),
    region=st.text(max_size=8),
    leaving=st.booleans(),
    ledger=st.dictionaries(names, st.floats(-1e6, 1e6), max_size=4),
    free_s=st.lists(st.floats(0, 1e6), max_size=8).map(lambda xs: tuple(sorted(xs))),
)
job_specs = st.builds(
    JobSpec,
    job_id=names,
    task=names,
    shards=st.integers(1, 1000),
    chain=st.booleans(),
    work_s=pos,
    gpus=st.integers(0, 8),
    mem_bytes=st.integers(0, 2**40),
    deadline_s=st.none() | pos,
    weight=st.floats(0.01, 100),
    lam=st.floats(0, 10),
    submitted_at=st.floats(-1e9, 1e9),
    params=st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5), max_size=3).map(pack_params),
)
shard_ids = st.lists(st.integers(0, 1000), min_size=1, max_size=10).map(tuple)
messages = st.one_of(
    peer_states,
    job_specs,
    st.builds(CallForBids, st.binary(max_size=100), shard_ids, small, st.just(1.0) | st.floats(0.001, 1.0)),
    st.builds(Bid, names, small, shard_ids, pos, pos, st.integers(1, 8), st.floats(0.01, 1), pos, pos, st.just("volunteer"),
              st.lists(st.floats(0, 1e6), max_size=16).map(lambda xs: tuple(sorted(xs)))),
    st.builds(Award, st.binary(max_size=100), names, small, small, st.floats(0.01, 100), st.floats(0.01, 1)),
    # a resumed run: the share left and the checkpoint it goes on from
    st.builds(Award, st.binary(max_size=100), names, small, small, st.floats(0.01, 100), st.floats(0.01, 1),
              st.floats(0.001, 0.999), st.binary(min_size=1, max_size=100)),
    st.builds(ShardCheckpoint, names, small, small, st.floats(0.001, 0.999), st.binary(min_size=1, max_size=100)),
    st.builds(AwardDecline, names, small, small, st.sampled_from(["late", "leaving", "moved"]), st.just("") | names),
    st.builds(SlotOffer, st.integers(1, 4096)),
    st.builds(LeaseAck, names, small, small, st.booleans(), pos),
    st.builds(ShardResult, names, small, small, st.booleans(), st.binary(max_size=100), st.text(max_size=20), pos, pos, pos),
    st.builds(Cancel, names, st.lists(small, max_size=5).map(tuple)),
    st.builds(LeaseRenewBatch, st.lists(st.builds(LeaseRenew, names, small, small, st.booleans(), pos),
                                        min_size=1, max_size=5).map(tuple)),
    st.builds(LeaseAckBatch, st.lists(st.builds(LeaseAck, names, small, small, st.booleans(), st.floats(0, 86400)),
                                      min_size=1, max_size=5).map(tuple)),
)


@settings(max_examples=300)
@given(messages, st.floats(-1e9, 1e9), st.integers(0, 2**63))
def test_round_trip(msg, issued_at, nonce) -> None:
    try:
        data = encode(msg, ALICE, issued_at=issued_at, nonce=nonce)
    except LocalProtocolError:
        # the sender refuses exactly what a receiver would refuse
        with pytest.raises(RemoteProtocolError):
            decode(encode(msg, ALICE, issued_at=issued_at, nonce=nonce, check=False))
        return
    got = decode(data)
    assert got.msg == msg
    assert got.author == ALICE.peer_id
    assert got.nonce == nonce


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_garbage_is_a_typed_error(data) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(data)


@settings(max_examples=300)
@given(messages, st.data())
def test_any_bit_flip_is_rejected_or_identical(msg, data) -> None:
    try:
        raw = bytearray(encode(msg, ALICE, issued_at=1.0, nonce=1))
    except LocalProtocolError:
        return
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        got = decode(bytes(raw))
    except RemoteProtocolError:
        return
    # a flip can only survive if it did not touch the signed payload's meaning
    assert got.msg == msg and got.author == ALICE.peer_id


@settings(max_examples=200)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | st.binary(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=20))
def test_wrong_shapes_are_rejected(obj) -> None:
    for payload in (msgpack.packb(obj), msgpack.packb([b"", msgpack.packb(obj)]), msgpack.packb([b"x" * 64, msgpack.packb([1, 5, ALICE.peer_id, 1.0, 1, obj, {}])])):
        with pytest.raises(RemoteProtocolError):
            decode(payload)


def test_forged_author_is_rejected() -> None:
    job = JobSpec("j", "t", 1, False, 1.0, 1, 0, None, 1.0, 0.0, 0.0, b"\x80")
    raw = encode(job, MALLORY, issued_at=1.0, nonce=1)
    sig, payload = msgpack.unpackb(raw)
    fields = msgpack.unpackb(payload)
    fields[2] = ALICE.peer_id  # claim to be Alice, keep Mallory's signature
    forged = msgpack.packb([sig, msgpack.packb(fields)])
    with pytest.raises(RemoteProtocolError) as exc:
        decode(forged)
    assert exc.value.reason == "bad-signature"


@settings(max_examples=100)
@given(st.binary(min_size=32, max_size=32), st.binary(max_size=600), st.integers(0, 10_000))
def test_signatures_are_ed25519_as_openssl_makes_them_and_refuse_any_change(seed, data, flip) -> None:
    # signing and checks run on libsodium; Ed25519 is deterministic, so
    # OpenSSL (through cryptography) must give the very same bytes
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedswarm.core.identity import verify

    me = Identity.from_seed(seed)
    sig = me.sign(data)
    assert sig == Ed25519PrivateKey.from_private_bytes(seed).sign(data)
    verify(me.peer_id, sig, data)
    blob = bytearray(sig + data)
    blob[flip % len(blob)] ^= 1 << (flip % 8)
    for bad_sig, bad_data in ((bytes(blob[:64]), bytes(blob[64:])), (sig[:63], data), (sig + b"\0", data)):
        with pytest.raises(RemoteProtocolError) as exc:
            verify(me.peer_id, bad_sig, bad_data)
        assert exc.value.reason == "bad-signature"
    with pytest.raises(RemoteProtocolError) as exc:
        verify(ALICE.peer_id if me.peer_id != ALICE.peer_id else MALLORY.peer_id, sig, data)
    assert exc.value.reason == "bad-signature"


def test_unsigned_claims_are_rejected_and_cannot_be_made() -> None:
    job = JobSpec("j", "t", 1, False, 1.0, 1, 0, None, 1.0, 0.0, 0.0, b"\x80")
    with pytest.raises(LocalProtocolError):
        encode(job, None, issued_at=1.0, nonce=1)
    raw = encode(job, ALICE, issued_at=1.0, nonce=1)
    _, payload = msgpack.unpackb(raw)
    with pytest.raises(RemoteProtocolError) as exc:
        decode(msgpack.packb([b"", payload]))
    assert exc.value.reason == "unsigned"
    # gossip containers are the one unsigned kind
    assert decode(encode(Gossip((), True), None, issued_at=1.0, nonce=1)).msg == Gossip((), True)
    assert decode(encode(Gossip((), True, 128), None, issued_at=1.0, nonce=1)).msg.want == 128
    with pytest.raises(LocalProtocolError):
        encode(Gossip((), True, 100_000), None, issued_at=1.0, nonce=1)


def test_older_peers_bodies_still_decode() -> None:
    # PeerState without free_s and Gossip without want: what peers that
    # predate those optional fields send
    st = PeerState(1, 30.0, (), 1, {"*": 1.0}, 0.0, PowerInfo(0, 0, 0, 0, 2.5, (1.0,)), 0.0, 0.0, (), "volunteer",
                   b"", (), "", False, {}, (4.0,))
    assert PeerState.from_body(st.to_body()[:16]) == msgspec.structs.replace(st, free_s=())
    assert Gossip.from_body([[], True]) == Gossip((), True, 0)
    with pytest.raises(RemoteProtocolError):
        PeerState.from_body(st.to_body()[:16] + [[5.0, 1.0]])  # free times must ascend
    # a Bid without next_s
    bid = Bid("j", 0, (0,), 1.0, 2.0, 4, 1.0, 5.0, 0.0, "volunteer", (3.0, 9.0))
    assert Bid.from_body(bid.to_body()[:10]) == msgspec.structs.replace(bid, next_s=())
    assert Bid.from_body(bid.to_body()) == bid
    with pytest.raises(RemoteProtocolError):
        Bid.from_body(bid.to_body()[:10] + [[9.0, 3.0]])  # further waits must ascend
    with pytest.raises(RemoteProtocolError):
        Bid.from_body(bid.to_body()[:10] + [[1.0] * 17])  # at most MAX_BID_NEXT
    # a decline without ``to`` is an older peer's; one that names no peer
    # leaves the field out of its bytes
    moved = AwardDecline("j", 2, 1, "moved", "p" * 52)
    assert AwardDecline.from_body(moved.to_body()[:4]) == AwardDecline("j", 2, 1, "moved")
    assert AwardDecline.from_body(moved.to_body()) == moved
    assert len(AwardDecline("j", 2, 1, "late").to_body()) == 4
    with pytest.raises(RemoteProtocolError):
        AwardDecline.from_body(moved.to_body()[:4] + ["p" * 129])  # a peer id is at most 128 characters


def test_a_fresh_call_and_award_are_the_bytes_older_clients_sent() -> None:
    # CallForBids.left and Award.left/resume came with checkpointed re-runs:
    # left at their defaults they are not sent, so an older peer reads the
    # message, and an older client's message decodes with the defaults
    cfb = CallForBids(b"job", (0, 1), 7)
    assert cfb.to_body() == [b"job", [0, 1], 7]
    assert CallForBids.from_body([b"job", [0, 1], 7]) == cfb
    assert CallForBids(b"job", (0,), 7, 0.25).to_body() == [b"job", [0], 7, 0.25]
    award = Award(b"job", "p", 1, 0, 8.0, 1.0)
    assert award.to_body() == [b"job", "p", 1, 0, 8.0, 1.0]
    assert Award.from_body([b"job", "p", 1, 0, 8.0, 1.0]) == award
    resumed = Award(b"job", "p", 1, 2, 8.0, 1.0, 0.4, b"state")
    assert decode(encode(resumed, ALICE, issued_at=1.0, nonce=1)).msg == resumed


def test_a_resumed_award_needs_its_state_and_a_checkpoint_is_progress() -> None:
    for body in ([b"job", "p", 1, 2, 8.0, 1.0, 0.4, b""],  # work left, nothing to go on from
                 [b"job", "p", 1, 2, 8.0, 1.0, 1.0, b"state"],  # a state, yet all the work left
                 [b"job", "p", 1, 2, 8.0, 1.0, 0.0, b"state"]):  # nothing left is no run
        with pytest.raises(RemoteProtocolError):
            Award.from_body(body)
        with pytest.raises(LocalProtocolError):  # nor may a client send one
            encode(Award(*body), ALICE, issued_at=1.0, nonce=1)
    with pytest.raises(RemoteProtocolError):
        CallForBids.from_body([b"job", [0], 7, 0.0])
    ok = ShardCheckpoint("j", 0, 1, 0.5, b"s")
    assert ShardCheckpoint.from_body(ok.to_body()) == ok
    for done, state in ((0.0, b"s"), (1.0, b"s"), (0.5, b""), (0.5, b"x" * (1024 * 1024 + 1))):
        with pytest.raises(RemoteProtocolError):
            ShardCheckpoint.from_body(["j", 0, 1, done, state])


def test_oversize_unknown_kind_and_version() -> None:
    with pytest.raises(RemoteProtocolError) as exc:
        decode(b"\x00" * 100, max_bytes=10)
    assert exc.value.reason == "oversize"
    payload = msgpack.packb([1, 99, ALICE.peer_id, 1.0, 1, [], {}])
    with pytest.raises(RemoteProtocolError) as exc:
        decode(msgpack.packb([ALICE.sign(payload), payload]))
    assert exc.value.reason == "unknown-kind"
    payload = msgpack.packb([2, 3, ALICE.peer_id, 1.0, 1, [], {}])
    with pytest.raises(RemoteProtocolError) as exc:
        decode(msgpack.packb([ALICE.sign(payload), payload]))
    assert exc.value.reason == "bad-version"


def test_guard_rejects_replays_and_stale_messages() -> None:
    g = Guard(max_skew_s=30.0)
    g.check("a", 1, 100.0, 100.0)
    with pytest.raises(RemoteProtocolError) as exc:
        g.check("a", 1, 100.0, 101.0)
    assert exc.value.reason == "replayed"
    g.check("b", 1, 100.0, 101.0)  # nonces are per author
    with pytest.raises(RemoteProtocolError) as exc:
        g.check("a", 2, 50.0, 101.0)
    assert exc.value.reason == "stale"
    with pytest.raises(RemoteProtocolError) as exc:
        g.check("a", 3, 200.0, 101.0)
    assert exc.value.reason == "stale"
    # after the window the cache forgets, but the message is stale by then
    with pytest.raises(RemoteProtocolError) as exc:
        g.check("a", 1, 100.0, 500.0)
    assert exc.value.reason == "stale"


def test_verify_cache_skips_repeat_verification_only_for_identical_bytes() -> None:
    cache = VerifyCache(capacity=4)
    raw = encode(Cancel("j", ()), ALICE, issued_at=1.0, nonce=1)
    decode(raw, cache=cache)
    decode(raw, cache=cache)
    assert cache.hits == 1
    tampered = raw[:-1] + bytes([raw[-1] ^ 1])
    with pytest.raises(RemoteProtocolError):
        decode(tampered, cache=cache)


def test_only_a_trusted_cache_takes_an_unchecked_signature() -> None:
    """netsim's fast mode signs with 64 zero bytes and decodes with a
    ``trusted`` cache; any other decode must refuse that signature, and a
    trusted one still checks everything else."""
    zero = msgspec.msgpack.Encoder()
    _, payload = msgspec.msgpack.decode(encode(Cancel("j", ()), ALICE, issued_at=1.0, nonce=1))
    raw = zero.encode((bytes(64), payload))
    for cache in (None, VerifyCache()):
        with pytest.raises(RemoteProtocolError) as exc:
            decode(raw, cache=cache)
        assert exc.value.reason == "bad-signature"
    trusted = VerifyCache(trusted=True)
    got = decode(raw, cache=trusted)
    assert got.msg == Cancel("j", ()) and got.author == ALICE.peer_id
    # an envelope that fails validation is refused all the same
    _, bad_payload = msgspec.msgpack.decode(encode(Cancel("j", ()), ALICE, issued_at=float("nan"), nonce=1))
    with pytest.raises(RemoteProtocolError) as exc:
        decode(zero.encode((bytes(64), bad_payload)), cache=trusted)
    assert exc.value.reason == "bad-field"


def test_a_trusted_cache_hands_receivers_the_message_that_was_sent() -> None:
    """netsim's fast mode: a sender enters what it encodes into the shared
    trusted cache, with the message object, and a receiver decodes nothing.
    An untrusted cache refuses that, and a receiver that accepts fewer bytes
    than the envelope holds decodes it, and refuses it, as always."""
    msg = Cancel("j", (1, 2))
    raw = encode(msg, ALICE, issued_at=2, nonce=7, check=False)
    with pytest.raises(ValueError):
        VerifyCache().remember(raw, MAX_MESSAGE_BYTES, msg, ALICE.peer_id, 2, 7)
    trusted = VerifyCache(trusted=True)
    trusted.remember(raw, MAX_MESSAGE_BYTES, msg, ALICE.peer_id, 2, 7)
    got = decode(raw, cache=trusted)
    assert got.msg is msg and trusted.hits == 1
    assert (got.author, got.issued_at, got.nonce, got.raw, got.extras) == (ALICE.peer_id, 2.0, 7, raw, {})
    assert type(got.issued_at) is float
    # the same fields as a decode of the bytes would give
    fresh = decode(raw)
    assert (fresh.msg, fresh.author, fresh.issued_at, fresh.nonce) == (got.msg, got.author, got.issued_at, got.nonce)
    small = VerifyCache(trusted=True)
    small.remember(raw, len(raw) - 1, msg, ALICE.peer_id, 2, 7)
    with pytest.raises(RemoteProtocolError) as exc:
        decode(raw, max_bytes=len(raw) - 1, cache=small)
    assert exc.value.reason == "oversize" and small.hits == 0


def test_verify_cache_keeps_states_while_messages_stream_past() -> None:
    """A peer state is gossiped for minutes, a message received once: a
    stream of messages beyond the capacity evicts messages only, so the
    state is not verified again (the signature check is the costly step)."""
    cache = VerifyCache(capacity=4)
    state = PeerState(1, 30.0, (), 1, {"*": 1.0}, 0.0, PowerInfo(0, 0, 0, 0, 2.5, (1.0,)), 0.0, 0.0, (),
                      "volunteer", b"", (), "", False, {}, (4.0,))
    raw_state = encode(state, ALICE, issued_at=1.0, nonce=1)
    first = decode(raw_state, cache=cache)
    msgs = [encode(Cancel(f"j{i}", ()), ALICE, issued_at=1.0, nonce=10 + i) for i in range(10)]
    for m in msgs:
        decode(m, cache=cache)
    hits = cache.hits
    assert decode(raw_state, cache=cache) is first and cache.hits == hits + 1
    decode(msgs[0], cache=cache)  # long evicted: decoded and verified again, not a hit
    assert cache.hits == hits + 1
    assert decode(msgs[-1], cache=cache) is not None and cache.hits == hits + 2


def test_peer_id_round_trip_and_rejects_non_ed25519() -> None:
    for _ in range(20):
        i = Identity.from_seed(random.Random(_).randbytes(32))
        assert public_bytes_from_peer_id(i.peer_id) == i.public_bytes()
        assert peer_id_from_public_bytes(i.public_bytes()) == i.peer_id
        assert i.peer_id.startswith("12D3KooW")
    with pytest.raises(RemoteProtocolError):
        public_bytes_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(RemoteProtocolError):
        public_bytes_from_peer_id("not base58 0OIl")


def test_every_kind_is_registered_once() -> None:
    assert sorted(KINDS) == list(range(1, len(KINDS) + 1))


def test_a_renewal_batch_is_checked_item_by_item() -> None:
    ok = LeaseRenewBatch((LeaseRenew("j", 0, 0, True, 5.0), LeaseRenew("j", 1, 2, False, 9.5)))
    assert LeaseRenewBatch.from_body(ok.to_body()) == ok
    with pytest.raises(RemoteProtocolError):
        LeaseRenewBatch.from_body([[]])  # empty
    with pytest.raises(RemoteProtocolError):
        LeaseRenewBatch.from_body([[["j", 0, 0, True]]])  # an item short of a field
    with pytest.raises(RemoteProtocolError):
        LeaseAckBatch.from_body([[["j", 0, 0, True, 1e9]]])  # a lease longer than a day


def _plain(v):
    """A message's field list written out by hand, as the msgpack package
    would see it: structs and tuples become lists, maps keep their order."""
    if isinstance(v, msgspec.Struct):
        return [_plain(getattr(v, f)) for f in v.__struct_fields__]
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@settings(max_examples=300)
@given(messages, st.floats(-1e9, 1e9), st.integers(0, 2**63))
def test_msgspec_encodes_the_bytes_msgpack_packb_gives(msg, issued_at, nonce) -> None:
    # the signature covers these bytes, so a peer built on the msgpack
    # package (or an older fedswarm) must produce and read the same ones
    raw = encode(msg, ALICE, issued_at=issued_at, nonce=nonce, check=False)
    sig, payload = msgpack.unpackb(raw)
    assert raw == msgpack.packb([sig, payload], use_bin_type=True)
    body = _plain(msg)
    if msg.OMIT_DEFAULT_TAIL:  # trailing fields at their defaults are left out, as older senders had none
        defaults = [_plain(d) for d in msg.__struct_defaults__]
        first = len(body) - len(defaults)
        while len(body) > first and body[-1] == defaults[len(body) - 1 - first]:
            body.pop()
    want = msgpack.packb([1, msg.KIND, ALICE.peer_id, float(issued_at), nonce, body, {}], use_bin_type=True)
    assert payload == want


def _reason(body, kind) -> str:
    payload = msgpack.packb([1, kind, ALICE.peer_id, 1.0, 1, body, {}], use_bin_type=True)
    with pytest.raises(RemoteProtocolError) as exc:
        decode(msgpack.packb([ALICE.sign(payload), payload], use_bin_type=True))
    return exc.value.reason


def test_bodies_are_checked_strictly() -> None:
    ack = LeaseAck("j", 1, 0, True, 5.0)
    good = _plain(ack)
    assert decode(encode(ack, ALICE, issued_at=1.0, nonce=1)).msg == ack
    assert _reason(good + [1], LeaseAck.KIND) == "bad-field"  # a field no reader knows
    assert _reason(good[:4], LeaseAck.KIND) == "bad-field"  # one missing
    assert _reason(["j", True, 0, True, 5.0], LeaseAck.KIND) == "bad-field"  # a bool for an int
    assert _reason(["j", 1.0, 0, True, 5.0], LeaseAck.KIND) == "bad-field"  # a float for an int
    assert _reason(["j", 1, 0, 1, 5.0], LeaseAck.KIND) == "bad-field"  # an int for a bool
    assert _reason(["j", 1, 0, True, float("nan")], LeaseAck.KIND) == "bad-field"
    assert _reason(["j", 1, 0, True, 1e9], LeaseAck.KIND) == "bad-field"  # past a day
    assert _reason(["", 1, 0, True, 5.0], LeaseAck.KIND) == "bad-field"  # an empty job id
    assert _reason(["j" * 129, 1, 0, True, 5.0], LeaseAck.KIND) == "bad-field"
    assert _reason({"job_id": "j"}, LeaseAck.KIND) == "malformed"  # not a field list
    # an int where a float goes is a float (what the msgpack package sends for 5)
    got = decode(msgpack.packb([ALICE.sign(p := msgpack.packb([1, LeaseAck.KIND, ALICE.peer_id, 1.0, 1, ["j", 1, 0, True, 5], {}])), p]))
    assert got.msg == ack and type(got.msg.lease_s) is float
    # nested structs are held to their own rules
    span = ["m", 3, 2, 1.0]  # ends before it starts
    st_ok = _plain(PeerState(1, 30.0, (), 1, {}, 0.0, PowerInfo(0, 0, 0, 0, 2.5, (1.0,)), 0.0, 0.0, (), "volunteer",
                             b"", (), "", False, {}))
    bad = list(st_ok)
    bad[9] = [span]
    assert _reason(bad, PeerState.KIND) == "bad-field"
    bad = list(st_ok)
    bad[6] = [0, 0, 0, 0, 2.5, []]  # no frequency levels
    assert _reason(bad, PeerState.KIND) == "bad-field"
    bad = list(st_ok)
    bad[4] = {"*": -1.0}
    assert _reason(bad, PeerState.KIND) == "bad-field"
