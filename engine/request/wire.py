"""The request contract on the wire: SamplingParams, TokenLogprobs and StopReason <-> their protobuf messages
(protos/serving.proto). Torch-free.

SamplingParams travels by its field table (engine/request/sampling_params.py), with no code per field: each field
has a proto field of the same name, and that field's declaration says how it travels —

    optional scalar   None is left unset; unset reads back as None where the field takes None (max_tokens: up to
                      max_model_len), else as the field's default (temperature: 1.0)
    plain scalar      not written when it is the field's default; unset (zero) reads back as the default (n: 1)
    repeated, map     a list, a dict
    message           a nested dataclass, field by field (GrammarSpec <-> StructuredOutputs)
    int64             (seed) a value in [2**63, 2**64) travels as its two's complement, which seeds a
                      torch.Generator identically (manual_seed maps negative seeds onto the same uint64)

`check_fits_wire` refuses the values a proto field cannot carry, for a sender to call before it sends.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from engine.request.logprobs import TokenLogprobs
from engine.request.sampling_params import SamplingParams
from engine.request.stop_reason import StopReason
from protos import serving_pb2

FLOAT32_MAX = 3.4028234663852886e38  # a larger float becomes inf in a protobuf `float` field
_INT_RANGES = {  # [low, high) of each integer field type; int64 takes uint64 values too, as two's complement
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31, "a 32-bit integer"),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31, "a 32-bit integer"),
    FieldDescriptor.TYPE_UINT32: (0, 2**32, "an unsigned 32-bit integer"),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**64, "a 64-bit integer"),
}
_PROTO_FIELDS = serving_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_TYPES = typing.get_type_hints(SamplingParams)


def sampling_params_to_proto(params: SamplingParams) -> serving_pb2.SamplingParams:
    msg = serving_pb2.SamplingParams()
    for field in dataclasses.fields(SamplingParams):
        value, wire = getattr(params, field.name), _PROTO_FIELDS[field.name]
        if value is None or (not wire.has_presence and not wire.is_repeated and value == field.default):
            continue
        if _is_map(wire):
            getattr(msg, field.name).update(value)
        elif wire.is_repeated:
            getattr(msg, field.name).extend(value)
        elif wire.message_type is not None:
            nested = getattr(msg, field.name)
            nested.SetInParent()
            for part in dataclasses.fields(value):
                setattr(nested, part.name, getattr(value, part.name))
        elif wire.type == FieldDescriptor.TYPE_INT64 and value >= 2**63:
            setattr(msg, field.name, value - 2**64)
        else:
            setattr(msg, field.name, value)
    return msg


def sampling_params_from_proto(msg: serving_pb2.SamplingParams) -> SamplingParams:
    """Unset fields keep vLLM's defaults (see the module docstring). The result is not validated yet."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParams):
        name, wire = field.name, _PROTO_FIELDS[field.name]
        if _is_map(wire):
            values[name] = dict(getattr(msg, name))
        elif wire.is_repeated:
            values[name] = list(getattr(msg, name))
        elif wire.has_presence:
            if msg.HasField(name):
                value = getattr(msg, name)
                values[name] = _nested(name, value) if wire.message_type is not None else value
            elif _takes_none(name):
                values[name] = None
        elif getattr(msg, name):
            values[name] = getattr(msg, name)
    return SamplingParams(**values)


def check_fits_wire(params: SamplingParams) -> None:
    """ValueError naming the first field whose value its proto field cannot carry: a float beyond float32's range
    (it would arrive as inf), an integer outside its field's range (protobuf would raise). `validate()` bounds
    most fields already; this is what the wire adds."""
    for field in dataclasses.fields(SamplingParams):
        value, wire = getattr(params, field.name), _PROTO_FIELDS[field.name]
        if value is None or (wire.message_type is not None and not _is_map(wire)):
            continue
        if _is_map(wire):
            _check_range(f"{field.name} keys", wire.message_type.fields_by_name["key"], value.keys())
            _check_range(f"{field.name} values", wire.message_type.fields_by_name["value"], value.values())
        else:
            _check_range(field.name, wire, value if wire.is_repeated else [value])


def logprobs_to_proto(lp: TokenLogprobs) -> serving_pb2.TokenLogprobs:
    return serving_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[serving_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(msg: serving_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank, top=[(t.token_id, t.logprob) for t in msg.top]
    )


def stop_reason_to_proto(reason: int | str) -> serving_pb2.StopReason:
    if isinstance(reason, str):
        return serving_pb2.StopReason(stop_string=reason)
    return serving_pb2.StopReason(stop_token_id=reason)


def stop_reason_from_proto(msg: serving_pb2.StopReason) -> StopReason:
    """None for an unset message (EOS)."""
    which = msg.WhichOneof("reason")
    return None if which is None else getattr(msg, which)


def _is_map(wire: FieldDescriptor) -> bool:
    return wire.message_type is not None and wire.message_type.GetOptions().map_entry


def _takes_none(name: str) -> bool:
    return type(None) in typing.get_args(_TYPES[name])


def _nested(name: str, msg: Any) -> Any:
    """The dataclass a message field holds (the non-None member of the field's type), from its fields."""
    (cls,) = (t for t in typing.get_args(_TYPES[name]) if t is not type(None))
    return cls(**{part.name: getattr(msg, part.name) for part in dataclasses.fields(cls)})


def _check_range(name: str, wire: FieldDescriptor, values: Iterable[Any]) -> None:
    if wire.type == FieldDescriptor.TYPE_FLOAT:
        bad = next((v for v in values if abs(v) > FLOAT32_MAX), None)
        if bad is not None:
            raise ValueError(f"{name} must be finite and at most {FLOAT32_MAX:.7g} in size (a 32-bit float), "
                             f"got {bad}")
    elif wire.type in _INT_RANGES:
        low, high, kind = _INT_RANGES[wire.type]
        bad = next((v for v in values if not low <= v < high), None)
        if bad is not None:
            raise ValueError(f"{name} must be in [{low}, {high}) ({kind}), got {bad}")
