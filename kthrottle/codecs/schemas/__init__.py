"""Message layouts of the share-group offset APIs (KIP-932) for kafka-python's schema
machinery, which has none of them: DescribeShareGroupOffsets (90), AlterShareGroupOffsets
(91) and DeleteShareGroupOffsets (92), in the versions Apache Kafka 4.4 offers. Each file
holds a message's fields in Kafka's message-definition format (names, types, versions),
read by ``codecs/share_offsets.py``."""
