"""Errors of the KV hand-off. Each says what went wrong and what to do; each maps to one gRPC code."""

from __future__ import annotations

import grpc


class HandoffError(Exception):
    """A prefill -> decode hand-off failed. `code` is the gRPC status it travels as."""

    code = grpc.StatusCode.INTERNAL


class LayoutMismatchError(HandoffError):
    """The two workers' KV caches differ (model, revision, dtype, block size, heads): nothing was written."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ChunkError(HandoffError):
    """A KV chunk failed verification (checksum, ranges, size, duplicate or missing slice)."""

    code = grpc.StatusCode.DATA_LOSS


class PrefillFailedError(HandoffError):
    """The prefill worker died, refused or aborted before every chunk arrived; the decode side may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class NoCapacityError(HandoffError):
    """The worker cannot hold the request's KV blocks now. Route it elsewhere or retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class WorkerUnavailableError(HandoffError):
    """A worker could not be reached, or no worker could serve the request."""

    code = grpc.StatusCode.UNAVAILABLE


class RequestAbortedError(HandoffError):
    """The request was aborted (client cancel, explicit abort, lease expiry)."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(HandoffError):
    """The request's deadline passed: every hop aborted it and freed its blocks. Not retried."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
