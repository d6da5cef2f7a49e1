"""The shape the pipeline keeps: functions short enough to read whole, and the
short way's records read by name, never by position (a ``known[7]`` says
nothing of what it reads, and breaks silently when a field is added)."""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
# where the bound holds: the pipeline, its adapter and server, and the frame cutter
BOUNDED = sorted((ROOT / "kthrottle" / "proxy").glob("*.py")) + [
    ROOT / "kthrottle" / "codecs" / "frames.py"]
PIPELINE = ROOT / "kthrottle" / "proxy" / "pipeline.py"
# the short way: what runs for each read of a client or a broker
REQUEST_PATH = {"pass_request", "_one_request", "_requests", "_judge_all", "_judged",
                "_renew_lease", "_mute_for", "pass_response", "_several_responses"}
# indexes that are not records read by position: the first of the requests
# awaiting an answer (a deque), and the head kept per API key (a list by key)
QUEUES = {"pending", "self.pending", "self._heads"}


def functions(path):
    tree = ast.parse(path.read_text(), str(path))
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_of_the_pipeline_is_over_80_lines():
    long = ["%s:%d %s (%d lines)" % (path.relative_to(ROOT), f.lineno, f.name,
                                     f.end_lineno - f.lineno + 1)
            for path in BOUNDED for f in functions(path)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def positional_reads(function):
    return ["line %d: %s" % (sub.lineno, ast.unparse(sub)) for sub in ast.walk(function)
            if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant)
            and isinstance(sub.slice.value, int) and ast.unparse(sub.value) not in QUEUES]


def test_the_short_way_reads_no_record_by_position():
    found = {f.name: positional_reads(f) for f in functions(PIPELINE) if f.name in REQUEST_PATH}
    assert set(found) == REQUEST_PATH, "renamed: %s" % sorted(REQUEST_PATH - set(found))
    assert not {name: reads for name, reads in found.items() if reads}


def test_the_checks_see_what_they_look_for():
    # the checks above would pass on nothing: each finds what it forbids
    source = ast.parse("def pass_request(self, data):\n    known = self._heads[0]\n"
                       "    return known[7] + pending[0]\n" + "    x = 1\n" * 80)
    [function] = [n for n in ast.walk(source) if isinstance(n, ast.FunctionDef)]
    assert positional_reads(function) == ["line 3: known[7]"]
    assert function.end_lineno - function.lineno + 1 > MAX_FUNCTION_LINES
