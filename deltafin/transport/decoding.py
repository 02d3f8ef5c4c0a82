"""Requests that are not the message their method takes are refused with INVALID_ARGUMENT, naming the method,
before the servicer sees them (gRPC's own answer to a request it cannot parse is UNKNOWN or INTERNAL, which reads
as the worker's fault). A server interceptor wraps every method's deserializer: a request that fails to parse
becomes a marker, and the method answers the marker with the status instead of running."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class Malformed:
    """A request the method's message type could not parse, and why."""

    why: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # whatever the protobuf runtime raises for bytes that are not the message
            return Malformed(f"{type(e).__name__}: {e}")

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, why: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message ({why})")


def _guard_unary(inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await _refuse(context, method, request.why)
        return await inner(request, context)

    return unary


def _guard_unary_stream(inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await _refuse(context, method, request.why)
        async for reply in inner(request, context):
            yield reply

    return unary_stream


def _guard_stream_stream(inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Malformed):
                    await _refuse(context, method, request.why)
                yield request

        async for reply in inner(checked(), context):
            yield reply

    return stream_stream


class DecodeGuard(grpc.aio.ServerInterceptor):
    """See the module docstring."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        parse, write = _tolerant(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard_unary(handler.unary_unary, method), parse, write)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard_unary_stream(handler.unary_stream, method), parse,
                                                        write)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard_stream_stream(handler.stream_stream, method), parse,
                                                         write)
        return handler
