"""Token-level stop decisions, made right after the engine appends one sampled token.

Rules, in order of precedence (the first that holds decides the finish reason):

1. Nothing but a length limit ends a sequence with fewer than ``min_tokens`` output tokens.
2. EOS (any of ``seq.eos_token_ids``), unless ``params.ignore_eos``: STOP, stop_reason = ``StopToken(id)``.
3. A token in ``params.stop_token_ids`` (applies even with ``ignore_eos``): STOP, same reason.
4. The output ends with ``params.stop_token_sequences[i]``: STOP, stop_reason = ``StopSequence(i)``
   (the first listed sequence that matches wins).
5. Structured output (``seq.grammar``): the output left the constraint (only possible when
   every allowed token was masked otherwise, e.g. by ``logit_bias``): ERROR
   (``invalid_structured_output``); the constraint is complete and admits nothing more: STOP,
   stop_reason = ``StopGrammar()``. Before ``min_tokens`` too: nothing else can follow.
6. ``num_output_tokens >= max_tokens`` or ``num_known_tokens >= max_model_len``: LENGTH.

With overlapped scheduling a later token may already be pending (sampled, not read back) when
this one is checked; only known tokens count, so the decision is the same as without overlap.

A stop that lands on the last allowed token reports STOP rather than LENGTH: the model ended the
text itself, so a client must not treat it as truncated (vLLM v0's order; vLLM v1 checks length
first).

Only the new token and the last ``len(stop_sequence)`` outputs are inspected, so the cost per
token is bounded by the stop sequences' total length, never by the output's length. Stop
*strings* are the frontend's job (it owns the tokenizer); see ``tandem/frontend/stops.py``.
"""

from __future__ import annotations

from tandem.core_protocol import SchedulerReason, SchedulerStop, StopGrammar, StopSequence, StopToken
from tandem.engine_service.sequence import FinishReason, Sequence


def check_stop(seq: Sequence, max_model_len: int) -> bool:
    """Finish ``seq`` (``seq.finish``) if its newest token ends it; return whether it is finished."""
    if seq.is_finished:
        return True
    params = seq.params
    output = seq.output_token_ids
    num_output = len(output)

    if num_output > 0 and num_output >= params.min_tokens:
        last = output[-1]
        if not params.ignore_eos and last in seq.eos_token_ids:
            seq.finish(FinishReason.STOP, StopToken(last))
            return True
        if last in params.stop_token_ids:
            seq.finish(FinishReason.STOP, StopToken(last))
            return True
        for index, stop_seq in enumerate(params.stop_token_sequences):
            length = len(stop_seq)
            # Comparing the last token first skips the slice for almost every token.
            if 0 < length <= num_output and stop_seq[-1] == last and output[-length:] == stop_seq:
                seq.finish(FinishReason.STOP, StopSequence(index))
                return True

    grammar = seq.grammar
    if grammar is not None and num_output > 0:
        if grammar.is_error:
            seq.finish(FinishReason.ERROR, SchedulerStop(SchedulerReason.INVALID_STRUCTURED_OUTPUT,
                                                         f"the output left the constraint: {grammar.error}"))
            return True
        if grammar.is_terminated:
            seq.finish(FinishReason.STOP, StopGrammar())
            return True

    if num_output >= params.max_tokens or seq.num_known_tokens >= max_model_len:
        seq.finish(FinishReason.LENGTH)
        return True
    return False
