"""The Apache Kafka test kit, under the name tests and benchmarks import it by. It lives in the
package (``kthrottle/kafka_kit.py``) because ``kthrottle local --broker kafka`` starts a node
with it too."""
import sys

from kthrottle import kafka_kit

sys.modules[__name__] = kafka_kit
