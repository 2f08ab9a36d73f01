"""Wire-level request checks that parsing alone cannot make.

Protobuf parsing accepts two things the service must reject: fields this server does not
know (a client asking for a sampling option we would silently ignore), and more than one
member of a oneof (the parser keeps the last, so `text` and `token_ids` sent together would
quietly lose one). The parser made here scans the raw bytes against the message descriptor
and, instead of raising (which grpc turns into INTERNAL), hands the handler an
InvalidRequest that it reports as INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor


class InvalidRequest:
    """Stands in for a request that failed the wire checks."""

    def __init__(self, message: str) -> None:
        self.message = message


def raise_if_invalid(request) -> None:
    if isinstance(request, InvalidRequest):
        raise ValueError(request.message)  # noqa: TRY004 - reported as INVALID_ARGUMENT


def parser(message_cls) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            message = message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends: any bad bytes
            return InvalidRequest(f"malformed {message_cls.DESCRIPTOR.name}: {e}")
        problem = find_problem(data, message_cls.DESCRIPTOR)
        return message if problem is None else InvalidRequest(problem)

    return parse


def find_problem(data: bytes, descriptor: Descriptor, path: str = "") -> str | None:
    """Describes the first unknown field or doubly-set oneof in data, or returns None."""
    where = path or descriptor.name
    seen_in_oneof: dict[str, str] = {}
    try:
        fields = list(_fields(data))
    except ValueError as e:
        return f"malformed {where}: {e}"
    for number, value in fields:
        field = descriptor.fields_by_number.get(number)
        if field is None:
            return f"{where}: unknown field number {number}"
        oneof = field.containing_oneof
        if oneof is not None and not _is_synthetic(oneof):
            other = seen_in_oneof.setdefault(oneof.name, field.name)
            if other != field.name:
                return f"{where}: set only one of {other} and {field.name} ({oneof.name})"
        if field.type == FieldDescriptor.TYPE_MESSAGE and value is not None:
            problem = find_problem(value, field.message_type, f"{where}.{field.name}")
            if problem is not None:
                return problem
    return None


def _is_synthetic(oneof) -> bool:
    """proto3 `optional` fields live in synthetic one-member oneofs named _<field>."""
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def _fields(data: bytes):
    """Yields (field number, bytes for length-delimited fields else None), top level only."""
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, i = _varint(data, i)
            yield number, None
        elif wire_type == 1:
            i += 8
            yield number, None
        elif wire_type == 2:
            length, i = _varint(data, i)
            yield number, data[i : i + length]
            i += length
        elif wire_type == 5:
            i += 4
            yield number, None
        else:
            raise ValueError(f"unsupported wire type {wire_type} for field {number}")
        if i > n:
            raise ValueError("truncated message")


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
