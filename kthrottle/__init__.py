"""kthrottle: a Kafka-protocol throttling proxy."""

__version__ = "0.1.0"
