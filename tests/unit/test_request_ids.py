"""RequestIdMap: uniqueness, duplicates, cleanup on every ending, n>1, threads."""

from __future__ import annotations

import re
import threading

import pytest

from tandem.frontend.request_ids import DuplicateRequestId, Registration, RequestIdMap


def test_register_with_and_without_client_id() -> None:
    ids = RequestIdMap(replica_prefix="fe-1")
    reg = ids.register("client-42", 1)
    assert isinstance(reg, Registration) and reg.external_id == "client-42"
    assert len(reg.internal_ids) == 1 and re.fullmatch(r"fe-1-[0-9a-f]{32}", reg.internal_ids[0])
    generated = ids.register(None, 1)
    assert generated.external_id and generated.external_id != "client-42"
    assert ids.internal_ids("client-42") == reg.internal_ids
    assert ids.external_for(reg.internal_ids[0]) == "client-42"
    assert len(ids) == 2 and ids.num_internal == 2


def test_fan_out_ids_carry_the_choice_index() -> None:
    ids = RequestIdMap(replica_prefix="r")
    internal = ids.register("x", 3).internal_ids
    assert len(set(internal)) == 3
    base = internal[0][:-2]
    assert internal == [f"{base}-{i}" for i in range(3)]


def test_default_prefix_is_valid() -> None:
    reg = RequestIdMap().register("a", 1)
    assert re.fullmatch(r"[A-Za-z0-9._-]+-[0-9a-f]{32}", reg.internal_ids[0])


def test_duplicate_in_flight_is_refused_and_reusable_after_release() -> None:
    ids = RequestIdMap(replica_prefix="r")
    first = ids.register("same", 2)
    with pytest.raises(DuplicateRequestId) as err:
        ids.register("same", 1)
    assert err.value.external_id == "same"
    assert ids.internal_ids("same") == first.internal_ids  # the refused call changed nothing
    assert ids.release("same") == first.internal_ids
    second = ids.register("same", 1)
    assert set(second.internal_ids).isdisjoint(first.internal_ids)


def test_release_is_idempotent_and_cleans_both_directions() -> None:
    ids = RequestIdMap(replica_prefix="r")
    reg = ids.register("a", 2)
    ids.release("a")
    assert ids.release("a") == []
    assert ids.release("never-seen") == []
    assert len(ids) == 0 and ids.num_internal == 0
    assert ids.internal_ids("a") == []
    assert all(ids.external_for(i) is None for i in reg.internal_ids)
    assert ids.release_internal(reg.internal_ids[0]) is False


def test_n_choices_release_one_by_one() -> None:
    ids = RequestIdMap(replica_prefix="r")
    reg = ids.register("multi", 3)
    assert ids.release_internal(reg.internal_ids[1]) is False
    assert ids.release_internal(reg.internal_ids[1]) is False  # idempotent
    assert "multi" in ids and ids.num_internal == 2
    assert ids.internal_ids("multi") == [reg.internal_ids[0], reg.internal_ids[2]]
    with pytest.raises(DuplicateRequestId):
        ids.register("multi", 1)  # still in flight while any choice runs
    assert ids.release_internal(reg.internal_ids[0]) is False
    assert ids.release_internal(reg.internal_ids[2]) is True
    assert "multi" not in ids and len(ids) == 0 and ids.num_internal == 0
    # A disconnect after some choices ended: release returns only those still running.
    reg = ids.register("multi", 2)
    ids.release_internal(reg.internal_ids[0])
    assert ids.release("multi") == [reg.internal_ids[1]]
    assert ids.num_internal == 0


def test_internal_ids_unique_over_10k() -> None:
    ids = RequestIdMap(replica_prefix="r")
    seen: set[str] = set()
    for i in range(10_000):
        seen.update(ids.register(None, 1 + i % 2).internal_ids)
    assert len(seen) == 15_000 == ids.num_internal
    assert len(ids) == 10_000
    # Two replicas configured with the same prefix still never collide.
    other = RequestIdMap(replica_prefix="r")
    assert not seen.intersection(other.register(None, 4).internal_ids)


@pytest.mark.parametrize(
    "bad,message",
    [("", "must not be empty"), ("x" * 257, "is 257 characters long; the limit is 256"),
     ("tab\there", "only printable ASCII"), ("newline\n", "only printable ASCII"), ("naïve", "only printable ASCII"),
     ("emoji🙂", "only printable ASCII"), ("\x7f", "only printable ASCII")],
)
def test_external_id_validation(bad: str, message: str) -> None:
    # The message reaches the client (INVALID_ARGUMENT details), so it must name the rule.
    with pytest.raises(ValueError, match=f"^request id .*{re.escape(message)}.*$"):
        RequestIdMap(replica_prefix="r").register(bad, 1)
    with pytest.raises(ValueError, match="^request id must be a string, got int$"):
        RequestIdMap(replica_prefix="r").register(7, 1)  # type: ignore[arg-type]


def test_external_id_limits_accepted() -> None:
    ids = RequestIdMap(replica_prefix="r")
    ids.register("x" * 256, 1)
    ids.register(" ~!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}", 1)
    with pytest.raises(ValueError, match="^n must be >= 1, got 0$"):
        ids.register("ok", 0)
    with pytest.raises(ValueError, match="^" + re.escape("replica prefix must be 1-64 characters from [A-Za-z0-9._-]") + "$"):
        RequestIdMap(replica_prefix="has space")


def test_concurrent_register_and_release() -> None:
    ids = RequestIdMap(replica_prefix="r")
    errors: list[BaseException] = []
    duplicates = [0]
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(w: int) -> None:
        try:
            barrier.wait()
            for i in range(500):
                # Half the ids are shared between two workers: exactly one may hold each at once.
                ext = f"shared-{w // 2}-{i}" if i % 2 else f"own-{w}-{i}"
                try:
                    reg = ids.register(ext, 1 + i % 3)
                except DuplicateRequestId:
                    with lock:
                        duplicates[0] += 1
                    continue
                for iid in reg.internal_ids:
                    assert ids.external_for(iid) == ext
                if i % 4 == 1:
                    ids.release(ext)
                else:
                    for iid in reg.internal_ids:
                        ids.release_internal(iid)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(ids) == 0 and ids.num_internal == 0  # nothing leaked
    assert duplicates[0] <= 8 * 250


def test_abort_is_recorded_from_registration_and_respects_the_owner() -> None:
    """Issue #10 failures 4 and 8: an abort is recorded on a request that is only registered,
    returns the choices still in flight once (then []), and another owner cannot abort it."""
    ids = RequestIdMap(replica_prefix="r")
    reg = ids.register("job", 3, owner="alice")
    assert not ids.is_aborted("job")
    assert ids.abort("job", caller="bob") is None and not ids.is_aborted("job")
    assert ids.abort("job", caller="alice") == reg.internal_ids
    assert ids.is_aborted("job")
    assert ids.abort("job", caller="alice") == []  # the first abort already ended every choice
    assert ids.abort("nobody") is None
    open_request = ids.register("shared", 1)  # no owner (auth off): anyone may abort
    assert ids.abort("shared", caller=None) == open_request.internal_ids
    owned = ids.register("owned", 1, owner="alice")
    assert ids.abort("owned", caller="bob", override=True) == owned.internal_ids  # an admin
    ids.release("job")
    assert not ids.is_aborted("job") and ids.abort("job", caller="alice") is None


# -- found by mutation testing (docs/testing.md) ------------------------------------------------


def test_defaults_one_choice_generated_id_and_frozen_registration() -> None:
    from dataclasses import FrozenInstanceError

    reg = RequestIdMap(replica_prefix="r").register(None)
    assert len(reg.internal_ids) == 1 and "-" not in reg.internal_ids[0].removeprefix("r-")
    assert re.fullmatch(r"req-[0-9a-f]{32}", reg.external_id)
    with pytest.raises(FrozenInstanceError):
        reg.external_id = "other"  # type: ignore[misc]


def test_duplicate_message_names_the_id() -> None:
    ids = RequestIdMap(replica_prefix="r")
    ids.register("abc")
    with pytest.raises(DuplicateRequestId, match="^" + re.escape("request id 'abc' is already in flight") + "$"):
        ids.register("abc")


@pytest.mark.parametrize(
    "hostname,host",
    [("node-1.example", "node-1.example"), ("my host!!x", "my-host-x"), ("--weird--", "weird"), ("", "host"),
     ("!!!", "host"), ("h" * 50, "h" * 40), ("Xbox-", "Xbox")],
)
def test_default_prefix_cleans_the_hostname(monkeypatch, hostname: str, host: str) -> None:
    import os
    import socket

    from tandem.frontend.request_ids import default_replica_prefix

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    assert default_replica_prefix() == f"{host}-{os.getpid()}"
