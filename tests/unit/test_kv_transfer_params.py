"""The typed `KVTransferParams` message, its conversions and the `x-tandem-kv-transfer` header."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format

from tandem.core_protocol import KVTransferParams
from tandem.proto_wire import (
    KV_TRANSFER_HEADER,
    MAX_KV_TRANSFER_PARAMS_BYTES,
    InvalidRequest,
    kv_transfer_from_dict,
    kv_transfer_from_header,
    kv_transfer_from_metadata,
    kv_transfer_from_proto,
    kv_transfer_params_of,
    kv_transfer_to_proto,
    refuse_removed_legacy_kv_params,
    to_struct,
)
from tandem.v1 import common_pb2, engine_pb2, frontend_pb2

FULL = KVTransferParams(
    do_remote_decode=False, do_remote_prefill=True, remote_engine_id="prefill-7", remote_block_ids=[3, 9, 2**40],
    remote_host="10.0.0.2", remote_port=7001, remote_group_block_ids=[[3, 9, 2**40], [5]], remote_state_slot=4,
    num_prompt_tokens=37, first_token_id=1234, lease_id="lease-1", lease_expiry_unix=1.8e9 + 0.25,
    remote_transport="tcp", block_size=16, extra={"router": "r1", "nested": {"a": [1.0, "b"]}},
)


def test_every_field_survives_msgspec_to_proto_and_back():
    msg = kv_transfer_to_proto(FULL)
    assert msg.remote_port == 7001 and list(msg.remote_group_block_ids[1].block_ids) == [5]
    back = kv_transfer_from_proto(common_pb2.KVTransferParams.FromString(msg.SerializeToString()))
    assert back == FULL


def test_unset_fields_stay_unset_both_ways():
    empty = kv_transfer_from_proto(common_pb2.KVTransferParams())
    assert empty == KVTransferParams()
    msg = kv_transfer_to_proto(KVTransferParams(do_remote_decode=True))
    assert msg.do_remote_decode and not msg.HasField("remote_port") and not msg.HasField("extra")
    assert not msg.remote_block_ids and not msg.HasField("lease_id")


def test_header_json_has_the_same_keys_as_the_message():
    data = {**{k: v for k, v in FULL.to_dict().items() if k != "extra"}, **FULL.extra}
    assert kv_transfer_from_header(json.dumps(data)) == FULL
    # The typed message's JSON form (unknown keys under "extra") is accepted too.
    assert kv_transfer_from_header(json.dumps({"do_remote_prefill": True, "extra": {"k": 1}})) == \
        KVTransferParams(do_remote_prefill=True, extra={"k": 1})


@pytest.mark.parametrize("value,field", [
    ("{not json", KV_TRANSFER_HEADER),
    ("[1, 2]", KV_TRANSFER_HEADER),
    (json.dumps({"remote_port": "7000"}), KV_TRANSFER_HEADER),
    (json.dumps({"remote_port": 70000}), f"{KV_TRANSFER_HEADER}.remote_port"),
    (json.dumps({"do_remote_decode": "yes"}), f"{KV_TRANSFER_HEADER}.do_remote_decode"),
    (json.dumps({"remote_host": 5}), f"{KV_TRANSFER_HEADER}.remote_host"),
    (json.dumps({"remote_block_ids": [1, -2]}), f"{KV_TRANSFER_HEADER}.remote_block_ids"),
    (json.dumps({"first_token_id": 1.5}), KV_TRANSFER_HEADER),
    (json.dumps({"block_size": 0}), f"{KV_TRANSFER_HEADER}.block_size"),
    (json.dumps({"num_prompt_tokens": 2**40}), KV_TRANSFER_HEADER),  # beyond the wire's int32
    (json.dumps({"extra": "x"}), f"{KV_TRANSFER_HEADER}.extra"),
    (json.dumps({"blob": "x" * MAX_KV_TRANSFER_PARAMS_BYTES}), KV_TRANSFER_HEADER),
])
def test_a_bad_header_is_refused_naming_it(value, field):
    with pytest.raises(InvalidRequest) as err:
        kv_transfer_from_header(value)
    assert err.value.field == field
    assert len(str(err.value)) < 400  # a clear line, not an echo of the whole header


def test_metadata_lookup_and_precedence():
    assert kv_transfer_from_metadata((("traceparent", "00-x"),)) is None
    with pytest.raises(InvalidRequest, match="given 2 times"):
        kv_transfer_from_metadata(((KV_TRANSFER_HEADER, "{}"), (KV_TRANSFER_HEADER, "{}")))
    req = engine_pb2.EngineRequest(request_id="r")
    assert kv_transfer_params_of(req, ()) is None
    req.kv_transfer_params.remote_engine_id = "body"
    req.kv_transfer_params.remote_block_ids.extend([1, 2])
    assert kv_transfer_params_of(req, ()).remote_engine_id == "body"
    # The header wins, whole: nothing of the body's parameters is merged in.
    from_header = kv_transfer_params_of(req, ((KV_TRANSFER_HEADER, '{"remote_engine_id": "hdr"}'),))
    assert from_header == KVTransferParams(remote_engine_id="hdr")


def test_range_checks_on_the_typed_message():
    for setter, field in [
        (lambda m: setattr(m, "remote_port", 0), "kv_transfer_params.remote_port"),
        (lambda m: m.remote_block_ids.append(-1), "kv_transfer_params.remote_block_ids"),
        (lambda m: m.remote_group_block_ids.add(block_ids=[-3]), "kv_transfer_params.remote_block_ids"),
        (lambda m: setattr(m, "lease_expiry_unix", float("nan")), "kv_transfer_params.lease_expiry_unix"),
        (lambda m: m.extra.update({"lease_id": "x"}), "kv_transfer_params.extra"),
    ]:
        msg = common_pb2.KVTransferParams()
        setter(msg)
        with pytest.raises(InvalidRequest) as err:
            kv_transfer_from_proto(msg)
        assert err.value.field == field
    big = common_pb2.KVTransferParams()
    big.extra.update({"blob": "x" * MAX_KV_TRANSFER_PARAMS_BYTES})
    with pytest.raises(InvalidRequest, match="bytes serialized"):
        kv_transfer_from_proto(big)


def test_the_public_and_engine_messages_carry_the_typed_message():
    for cls in (frontend_pb2.GenerateRequest, frontend_pb2.GenerateResponse, frontend_pb2.GenerateStreamResponse,
                engine_pb2.EngineRequest, engine_pb2.EngineResponse):
        assert cls.DESCRIPTOR.fields_by_name["kv_transfer_params"].message_type.full_name == "tandem.v1.KVTransferParams"
    # Every named field of the contract has a wire field of the same name.
    wire = set(common_pb2.KVTransferParams.DESCRIPTOR.fields_by_name)
    assert set(KVTransferParams._NAMED) | {"extra"} == wire


# Field numbers published before the typed message, where the untyped Struct lived.
STRUCT_ERA_NUMBERS = {frontend_pb2.GenerateRequest: 9, frontend_pb2.GenerateResponse: 5,
                      frontend_pb2.GenerateStreamResponse: 5, engine_pb2.EngineRequest: 5, engine_pb2.EngineResponse: 9}


def test_no_field_number_changed_its_type():
    """The typed message took new numbers and the Struct-era ones are reserved: no old sender's
    bytes are read as a different type."""
    for cls, number in STRUCT_ERA_NUMBERS.items():
        desc = cls.DESCRIPTOR
        assert desc.fields_by_name["kv_transfer_params"].number != number
        assert desc.fields_by_number.get(number) is None, f"{desc.name} field {number} must stay reserved"
        assert "legacy_kv_transfer_params" not in desc.fields_by_name


def test_a_request_in_the_removed_struct_form_is_refused():
    """Bytes of a client built against the removed Struct field (9) are refused naming it, not
    served silently without their transfer; a request without them passes."""
    struct = to_struct({"remote_engine_id": "old-router"}).SerializeToString()
    old = frontend_pb2.GenerateRequest.FromString(frontend_pb2.GenerateRequest(prompt="hi").SerializeToString()
                                                  + bytes([9 << 3 | 2, len(struct)]) + struct)
    with pytest.raises(InvalidRequest) as err:
        refuse_removed_legacy_kv_params(old)
    assert err.value.field == "legacy_kv_transfer_params" and "kv_transfer_params" in str(err.value)
    refuse_removed_legacy_kv_params(frontend_pb2.GenerateRequest(prompt="hi"))


def test_python_client_dict_becomes_the_typed_message():
    from tandem.client import build_request

    req = build_request(prompt="hi", kv_transfer_params={"do_remote_decode": True, "remote_port": 7000.0, "x": 1})
    assert req.kv_transfer_params.do_remote_decode and req.kv_transfer_params.remote_port == 7000
    assert dict(req.kv_transfer_params.extra) == {"x": 1}
    with pytest.raises(InvalidRequest):
        kv_transfer_from_dict({"remote_port": "no"})


def test_the_header_accepts_the_producer_parameters_as_protobuf_prints_them():
    """Issue 19 item 10: the returned parameters printed by json_format (camelCase, int64 as
    strings, groups as {"blockIds": [...]}) come back as the same parameters, not as extra."""
    from google.protobuf import json_format

    returned = KVTransferParams(do_remote_prefill=True, remote_engine_id="prod", remote_host="10.0.0.2",
                                remote_port=6000, remote_block_ids=[7, 8], remote_group_block_ids=[[7, 8], [9, 10]],
                                remote_state_slot=3, num_prompt_tokens=17, first_token_id=42, lease_id="L",
                                lease_expiry_unix=1.5e9, remote_transport="tcp", block_size=16, lease_secret="S",
                                extra={"router": "r1"})
    printed = json_format.MessageToDict(kv_transfer_to_proto(returned))
    assert "remoteBlockIds" in printed and printed["remoteBlockIds"] == ["7", "8"]  # the printer's form
    parsed = kv_transfer_from_header(json.dumps(printed))
    assert parsed == returned and parsed.extra == {"router": "r1"}
    # The field names still work, and an int32 given as a string is still refused.
    assert kv_transfer_from_header(json.dumps(returned.to_dict())) == returned
    with pytest.raises(InvalidRequest):
        kv_transfer_from_header(json.dumps({"remotePort": "6000"}))
    with pytest.raises(InvalidRequest, match="remote_block_ids"):
        kv_transfer_from_header(json.dumps({"remoteBlockIds": ["7", "x"]}))


def test_only_extra_is_public():
    """What a frontend shows a caller it does not trust: extra, never a pull address, lease,
    secret or block ids; and what it refuses from one: anything besides extra."""
    from tandem.proto_wire import kv_params_steer, public_kv_params

    full = kv_transfer_to_proto(KVTransferParams(do_remote_prefill=True, remote_host="10.0.0.2", remote_port=6000,
                                                 lease_id="L", lease_secret="S", remote_block_ids=[1],
                                                 extra={"router": "r1"}))
    shown = public_kv_params(full)
    assert kv_transfer_from_proto(shown) == KVTransferParams(extra={"router": "r1"})
    assert public_kv_params(kv_transfer_to_proto(KVTransferParams(lease_id="L"))) is None
    assert kv_params_steer(full) and not kv_params_steer(shown)
    assert kv_params_steer(kv_transfer_to_proto(KVTransferParams(do_remote_decode=True)))


def test_error_details_echo_a_bounded_part_of_what_the_caller_sent():
    """Issue 19 item 16: a 24 KiB id is echoed in at most MAX_ECHO_CHARS characters (a status's
    details travel in trailing metadata, bounded to 8 KiB by default)."""
    from tandem.error_text import MAX_DETAIL_CHARS, MAX_ECHO_CHARS, bounded, echo

    long_id = "x" * (24 * 1024)
    text = f"request_id {echo(long_id)} is not in flight"
    assert len(text) < MAX_ECHO_CHARS + 64 and "(24576 characters)" in text
    assert echo("abc") == "'abc'"
    assert len(bounded("e" * 100_000)) < MAX_DETAIL_CHARS + 32 and bounded("short") == "short"
