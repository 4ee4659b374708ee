"""One choice's text view: engine token deltas in, text deltas with stop handling out."""

from __future__ import annotations

from tandem.frontend.decode_stream import new_detokenizer
from tandem.frontend.stops import StopStringMatcher
from tandem.frontend.tokenizer import TextTokenizer
from tandem.v1 import common_pb2, engine_pb2, frontend_pb2


class ChoiceState:
    """Detokenizes one engine stream incrementally and applies stop strings as the final word.

    The engine may stop early on an encoded stop sequence, but only the text decides what the
    client sees: text up to the first stop string (or including it when asked), nothing after.
    """

    def __init__(
        self,
        index: int,
        tokenizer: TextTokenizer,
        prompt_token_ids: list[int],
        stops: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        stop_sequence_owner: list[int],
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.detok = new_detokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stops, include_stop_str_in_output) if stops else None
        self.stops = stops
        # stop_sequence_owner[i] = index in `stops` of the string that engine stop sequence i encodes.
        self.stop_sequence_owner = stop_sequence_owner
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finished = False
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.stop_str: str | None = None
        self.stop_token_id: int | None = None
        self.usage = common_pb2.Usage()
        self.logprobs: list[common_pb2.Logprobs] = []
        # Prompt logprobs (positions 1, 2, ... with text; only the choice that asked gets them)
        # and how many of them a stream message carried already.
        self.prompt_logprobs: list[common_pb2.Logprobs] = []
        self._prompt_logprobs_sent = 0
        self.kv_transfer_params = None  # as returned by the engine's final message

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def on_engine(self, resp: engine_pb2.EngineResponse) -> frontend_pb2.Choice:
        """Consumes one engine message; returns this choice's delta (maybe empty)."""
        delta = frontend_pb2.Choice(index=self.index)
        if self.finished:
            return delta
        ids = list(resp.token_ids)
        self.token_ids.extend(ids)
        delta.token_ids.extend(ids)
        for lp in resp.logprobs:
            self._with_text(delta.logprobs.add(), lp)
        self.logprobs.extend(delta.logprobs)
        for lp in resp.prompt_logprobs:
            entry = common_pb2.Logprobs()
            self._with_text(entry, lp)
            self.prompt_logprobs.append(entry)
        text = self.detok.push(ids) if ids else ""
        engine_done = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if engine_done:
            text += self.detok.flush()
        out = self._match(text)
        if not self.finished and engine_done:
            if self.matcher is not None:
                out += self.matcher.flush()
            self.finished = True
            self.finish_reason = resp.finish_reason
            which = resp.WhichOneof("matched_stop")
            if which == "stop_token_id":
                self.stop_token_id = resp.stop_token_id
            elif which == "stop_sequence_index" and resp.stop_sequence_index < len(self.stop_sequence_owner):
                # The engine matched the tokens of a stop string that the text never showed
                # (a tokenization quirk): still report which stop string ended the choice.
                self.stop_str = self.stops[self.stop_sequence_owner[resp.stop_sequence_index]]
        if self.finished:
            self._fill_ending(delta)
        if resp.HasField("usage"):
            self.usage.CopyFrom(resp.usage)
        if resp.HasField("kv_transfer_params"):
            self.kv_transfer_params = resp.kv_transfer_params
        delta.text = out
        self.text_parts.append(out)
        return delta

    def take_new_prompt_logprobs(self) -> list[common_pb2.Logprobs]:
        """The prompt logprobs that arrived since the last call (a stream message's share)."""
        new = self.prompt_logprobs[self._prompt_logprobs_sent:]
        self._prompt_logprobs_sent = len(self.prompt_logprobs)
        return new

    def _with_text(self, entry: common_pb2.Logprobs, lp: common_pb2.Logprobs) -> None:
        """`entry` = `lp` with the text of its token and of each alternative."""
        entry.CopyFrom(lp)
        entry.text = self.tokenizer.decode([lp.token_id], skip_special_tokens=False)
        for top in entry.top:
            top.text = self.tokenizer.decode([top.token_id], skip_special_tokens=False)

    def _match(self, text: str) -> str:
        if self.matcher is None:
            return text
        result = self.matcher.feed(text)
        if result.finished:
            self.finished = True
            self.finish_reason = common_pb2.FINISH_REASON_STOP
            self.stop_str = result.matched
        return result.text

    def _fill_ending(self, delta: frontend_pb2.Choice) -> None:
        delta.finish_reason = self.finish_reason
        if self.stop_str is not None:
            delta.stop_str = self.stop_str
        elif self.stop_token_id is not None:
            delta.stop_token_id = self.stop_token_id

    def abort_delta(self, reason: int) -> frontend_pb2.Choice:
        """Ends the choice without an engine message (engine lost, request aborted)."""
        self.finished = True
        self.finish_reason = reason
        delta = frontend_pb2.Choice(index=self.index)
        self._fill_ending(delta)
        return delta
