"""The engine's outputs as the worker's stream messages: a finished request's stop reason keeps its kind."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.request.wire import stop_reason_from_proto
from worker.convert import output_to_response


def finished(stop_reason: int | str | None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], token_ids=[5, 7], text="ab", new_token_ids=[7],
                         finished=True, finish_reason="stop", stop_reason=stop_reason)


def test_a_stop_token_and_a_stop_string_that_read_alike_stay_apart() -> None:
    by_token, by_string = output_to_response(finished(7)), output_to_response(finished("7"))
    assert by_token.stop_reason.WhichOneof("reason") == "stop_token_id" and by_token.stop_reason.stop_token_id == 7
    assert by_string.stop_reason.WhichOneof("reason") == "stop_string" and by_string.stop_reason.stop_string == "7"
    assert stop_reason_from_proto(by_token.stop_reason) == 7 and stop_reason_from_proto(by_string.stop_reason) == "7"


def test_eos_sets_no_stop_reason() -> None:
    message = output_to_response(finished(None))
    assert message.finish_reason == "stop" and not message.HasField("stop_reason")
    assert stop_reason_from_proto(message.stop_reason) is None
