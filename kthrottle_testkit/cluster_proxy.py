"""A benchmark's proxy in front of every node of an Apache Kafka cluster (``kafka_kit``): the
first node as its upstream, the others as more bootstrap servers, and a port of its own for
each node id (``--node-ports``), checked to be what Metadata through it names, so that the
clients stay behind it (``benchmarks/throttle_accuracy.py``, ``benchmarks/nothing_lost_java.py``).
"""
from kthrottle import kafka_kit

from . import harness


def start_cluster_proxy(run, cluster, extra, name):
    """``run.kthrottle`` (a ``harness.Run``) in front of every node of ``cluster`` with the
    flags ``extra`` (not changed) and the node ports, its admin endpoint on; once Metadata
    through it names its own ports only (else RuntimeError, the proxy stopped), and those
    ports are open."""
    nodes = list(cluster.nodes.values())
    ports = {node.node_id: harness.free_port() for node in nodes}
    extra = list(extra)
    for node in nodes[1:]:
        extra += ["--bootstrap-server", node.bootstrap]
    extra += ["--node-ports", ",".join("%d=%d" % item for item in ports.items())]
    proxy = run.kthrottle(nodes[0].bootstrap, extra, admin=True, name=name, probe=False)
    named = {b[0]: (b[1], b[2]) for b in kafka_kit.metadata_brokers(
        "127.0.0.1", proxy.port, timeout=10)[0]}
    if named != {n: ("127.0.0.1", p) for n, p in ports.items()}:
        run.procs.stop(proxy.proc)
        raise RuntimeError("Metadata through the proxy names %s, not its own ports %s"
                           % (named, ports))
    for port in ports.values():  # opened by that first Metadata answer
        harness.wait_for_port("127.0.0.1", port, timeout=10, proc=proxy.proc)
    return proxy
