"""ChoiceState: one choice's engine token stream in, client text deltas with stop handling out.
Found by mutation testing (docs/testing.md): these pin what each engine message does to the
delta a client receives and to the choice's final state."""

from __future__ import annotations

import pytest

from tandem.frontend.choice_state import ChoiceState
from tandem.frontend.tokenizer import TextTokenizer
from tandem.v1 import common_pb2, engine_pb2

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> TextTokenizer:
    return TextTokenizer.from_pretrained(smollm2_dir)


def make(tok, stops=(), include=False, skip=True, owner=(), index=3, prompt="Say it:") -> ChoiceState:
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    return ChoiceState(index, tok, prompt_ids, list(stops), include, skip, list(owner))


def engine(ids=(), finish=UNSPECIFIED, **kw) -> engine_pb2.EngineResponse:
    resp = engine_pb2.EngineResponse(token_ids=list(ids), finish_reason=finish)
    for k, v in kw.items():
        if k in ("usage", "kv_transfer_params"):
            getattr(resp, k).CopyFrom(v)
        else:
            setattr(resp, k, v)
    return resp


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_token_deltas_become_text_deltas(tok):
    c = make(tok)
    first, second = ids_of(tok, " Hello"), ids_of(tok, " world")
    d1 = c.on_engine(engine(first))
    assert (d1.index, d1.text, list(d1.token_ids), d1.finish_reason) == (3, " Hello", first, UNSPECIFIED)
    assert d1.WhichOneof("matched_stop") is None
    d2 = c.on_engine(engine(second))
    assert (d2.text, list(d2.token_ids)) == (" world", second)
    assert c.text == " Hello world" and c.token_ids == first + second
    assert c.finished is False and c.finish_reason == UNSPECIFIED
    assert c.stop_str is None and c.stop_token_id is None


def test_engine_finish_with_a_stop_token(tok):
    c = make(tok)
    eos = tok.eos_token_ids[0]
    body = ids_of(tok, " Done.")
    d = c.on_engine(engine(body + [eos], STOP, stop_token_id=eos))
    assert d.text == " Done." and d.finish_reason == STOP
    assert d.WhichOneof("matched_stop") == "stop_token_id" and d.stop_token_id == eos
    assert c.finished and c.finish_reason == STOP and c.stop_token_id == eos and c.stop_str is None
    # A finished choice ignores later messages: an empty delta with its index only.
    late = c.on_engine(engine(ids_of(tok, " more"), LENGTH))
    assert late == type(late)(index=3)
    assert c.text == " Done." and c.finish_reason == STOP


def test_length_finish_flushes_the_held_tail(tok):
    c = make(tok)
    ids = ids_of(tok, " 𝔘")
    assert len(ids) >= 2 and tok.decode(ids[:-1]).endswith("\ufffd")
    d0 = c.on_engine(engine(ids[:-1]))
    assert "\ufffd" not in d0.text  # the incomplete character is held
    d = c.on_engine(engine([], LENGTH))
    prompt = ids_of(tok, "Say it:")
    assert d0.text + d.text == tok.decode(prompt + ids[:-1])[len(tok.decode(prompt)):]
    assert d.text.endswith("\ufffd")  # released by the flush at the end
    assert c.text == d0.text + d.text and d.finish_reason == LENGTH and c.finish_reason == LENGTH
    assert d.WhichOneof("matched_stop") is None and c.finished


def test_stop_string_cuts_the_text_and_finishes(tok):
    c = make(tok, stops=["STOP"])
    d = c.on_engine(engine(ids_of(tok, " one STOP two")))
    assert d.text == " one " and d.finish_reason == STOP
    assert d.WhichOneof("matched_stop") == "stop_str" and d.stop_str == "STOP"
    assert c.finished and c.stop_str == "STOP" and c.finish_reason == STOP
    assert c.on_engine(engine(ids_of(tok, " three"), LENGTH)).text == ""
    assert c.text == " one "


def test_stop_string_included_when_asked(tok):
    c = make(tok, stops=["STOP"], include=True)
    assert c.on_engine(engine(ids_of(tok, " one STOP two"))).text == " one STOP"


def test_text_held_for_a_possible_stop_is_released_at_the_end(tok):
    c = make(tok, stops=["Hello there"])
    d1 = c.on_engine(engine(ids_of(tok, " Hello")))
    assert d1.text == " "  # "Hello" could start the stop string
    d2 = c.on_engine(engine([], LENGTH))
    assert d2.text == "Hello" and d2.finish_reason == LENGTH and not c.stop_str
    assert c.text == " Hello"


def test_stop_sequence_matched_by_the_engine_names_its_string(tok):
    c = make(tok, stops=["alpha", "beta"], owner=[1, 0])
    d = c.on_engine(engine(ids_of(tok, " text"), STOP, stop_sequence_index=0))
    assert d.stop_str == "beta" and c.stop_str == "beta" and d.finish_reason == STOP
    c2 = make(tok, stops=["alpha", "beta"], owner=[1, 0])
    assert c2.on_engine(engine([], STOP, stop_sequence_index=1)).stop_str == "alpha"
    # An index the frontend did not send names nothing.
    c3 = make(tok, stops=["alpha"], owner=[0])
    d3 = c3.on_engine(engine([], STOP, stop_sequence_index=1))
    assert d3.WhichOneof("matched_stop") is None and c3.stop_str is None and c3.finished


def test_logprobs_get_their_token_texts(tok):
    c = make(tok)
    ids = ids_of(tok, " Hi")
    eos = tok.eos_token_ids[0]
    lp = common_pb2.Logprobs(token_id=ids[0], logprob=-0.5, rank=1)
    lp.top.add(token_id=eos, logprob=-1.0)
    lp.top.add(token_id=ids[0], logprob=-0.5)
    resp = engine(ids[:1])
    resp.logprobs.append(lp)
    d = c.on_engine(resp)
    assert len(d.logprobs) == 1
    entry = d.logprobs[0]
    assert (entry.token_id, entry.logprob, entry.rank) == (ids[0], -0.5, 1)
    assert entry.text == tok.decode([ids[0]], skip_special_tokens=False)
    assert entry.top[0].text == tok.decode([eos], skip_special_tokens=False) != ""
    assert entry.top[1].text == entry.text
    assert list(c.logprobs) == list(d.logprobs)


def test_special_tokens_kept_in_text_when_not_skipped(tok):
    eos = tok.eos_token_ids[0]
    special = tok.decode([eos], skip_special_tokens=False)
    body = ids_of(tok, " a")
    kept = make(tok, skip=False)
    kept.on_engine(engine(body + [eos], STOP, stop_token_id=eos))
    assert kept.text == " a" + special
    skipped = make(tok, skip=True)
    skipped.on_engine(engine(body + [eos], STOP, stop_token_id=eos))
    assert skipped.text == " a"


def test_usage_and_kv_transfer_params_are_kept(tok):
    c = make(tok)
    usage = common_pb2.Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6)
    kv = common_pb2.KVTransferParams(do_remote_decode=True)
    c.on_engine(engine(ids_of(tok, " x")))
    assert c.usage == common_pb2.Usage() and c.kv_transfer_params is None
    c.on_engine(engine([], LENGTH, usage=usage, kv_transfer_params=kv))
    assert c.usage == usage and c.kv_transfer_params == kv


def test_abort_ends_the_choice_with_what_matched(tok):
    c = make(tok)
    c.on_engine(engine(ids_of(tok, " partial")))
    d = c.abort_delta(common_pb2.FINISH_REASON_ABORT)
    assert d.index == 3 and d.finish_reason == common_pb2.FINISH_REASON_ABORT and d.text == ""
    assert d.WhichOneof("matched_stop") is None
    assert c.finished and c.finish_reason == common_pb2.FINISH_REASON_ABORT
    stopped = make(tok, stops=["X"])
    stopped.stop_str = "X"
    stopped.stop_token_id = 7
    assert stopped.abort_delta(common_pb2.FINISH_REASON_ABORT).stop_str == "X"  # the string wins
    by_token = make(tok)
    by_token.stop_token_id = 7
    assert by_token.abort_delta(common_pb2.FINISH_REASON_ERROR).stop_token_id == 7


def test_last_message_text_and_held_text_both_go_out(tok):
    # The engine's final message carries tokens too; with stop strings configured, its text
    # and whatever the matcher held go out together.
    c = make(tok, stops=["zebra crossing"])
    d = c.on_engine(engine(ids_of(tok, " one two zebra"), LENGTH))
    assert d.text == " one two zebra" and c.text == " one two zebra" and d.finish_reason == LENGTH


def test_logprob_text_of_a_special_token_is_its_text(tok):
    eos = tok.eos_token_ids[0]
    c = make(tok)
    resp = engine([eos], STOP, stop_token_id=eos)
    resp.logprobs.append(common_pb2.Logprobs(token_id=eos, logprob=-0.1, rank=1))
    d = c.on_engine(resp)
    assert d.logprobs[0].text == tok.decode([eos], skip_special_tokens=False) != ""
    assert d.text == ""  # the text itself skips it
