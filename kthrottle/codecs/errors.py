class ProtocolError(Exception):
    """A peer sent bytes that are not a valid Kafka frame or message.

    The one error type the codecs raise: the proxy closes the one connection
    that sent them and logs this error's message as the reason.
    """


REQUEST_TIMED_OUT = 7  # retriable everywhere: the request was not written
THROTTLING_QUOTA_EXCEEDED = 89  # KIP-599: a controller mutation refused over its quota
