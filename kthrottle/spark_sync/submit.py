"""The file to hand spark-submit: ``spark-submit [SPARK OPTIONS] <this file>
[kthrottle spark-sync FLAGS]`` runs ``kthrottle spark-sync`` with the master
and the settings spark-submit was given (spark-submit runs only a .py file
as a Python application). Its path:
``python -c 'import kthrottle.spark_sync.submit as s; print(s.__file__)'``.
"""
import os
import sys

if __name__ == "__main__":
    # run as a file, its own directory comes first on sys.path: the package's
    # modules are imported from the package only
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]

    from kthrottle.cli import main

    sys.exit(main(["spark-sync", *sys.argv[1:]]))
