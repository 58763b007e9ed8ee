"""The suite's check that no test compares floats exactly unless both sides run the same operations in the same order.

Two computations of one number that differ in their order (a sum by blocks and one by one, a numpy loop and a
Python scalar, a value recorded on another machine) may differ in the last bit on a host whose SIMD path differs
(numpy's AVX-512 ``pow`` against libm's, a BLAS kernel's reduction order): such a test passes on one machine and
fails on the next. So every exact comparison whose two sides both hold computed floats must say why it is exact:

- ``assert a == b``, where both sides hold a float with more than :data:`SHORT_DIGITS` significant digits (a
  computation's result, not a round value read back) and are not the same objects (``xs == sorted(xs)`` compares
  one computation's values with themselves), found as the assertion runs
  (``pytest_assertrepr_compare`` sees the operands of passing assertions too, with pytest's
  ``enable_assertion_pass_hook``);
- ``torch.equal``, ``np.array_equal``, ``np.testing.assert_array_equal`` and ``np.testing.assert_equal`` on such
  values, called from a file under ``tests/``.

Either compare with a tolerance (``pytest.approx(want, rel=...)``, ``torch.testing.assert_close``) that names why
it is that wide, or, where both sides are the same operations in the same order on the same inputs (a resume
against the uninterrupted run, a file written and read back, one function called twice), end the line with
``# exact: <why>`` (or put that comment on the line above the statement). Floats of up to twelve significant
digits are values a test wrote or read back, and compare exactly without a word; ``a != b`` says two results
differ, which no last bit undoes. What the check cannot see: the
workers of multi-process tests (their own interpreters, without pytest), and floats inside objects it does not
open (it opens lists, tuples, sets, dicts, dataclasses, numpy arrays and torch tensors).
"""

from __future__ import annotations

import dataclasses
import functools
import linecache
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# A float of more digits than this is a computation's result (0.1 * 3 is 0.30000000000000004): a round value a
# test wrote (0.0016, 1.25, 2.5e-05) has a handful.
SHORT_DIGITS = 12
MARK = "# exact:"
# Elements looked at in one array or container: enough to find a computed float in any test's values.
MAX_ELEMENTS = 4096
# For an audit: every finding appended to this file (one line each) rather than failing its test.
REPORT = os.environ.get("FLEXMESH_EXACTNESS_REPORT")


def _long(x: float) -> bool:
    return x == x and abs(x) != float("inf") and x != float(format(x, f".{SHORT_DIGITS}g"))


def holds_computed_float(value: object, depth: int = 0) -> bool:
    """Whether ``value`` holds a float of more than :data:`SHORT_DIGITS` significant digits.

    >>> holds_computed_float([1, 0.5, {"a": (2.5e-05,)}]), holds_computed_float({"t": 0.1 * 3})
    (False, True)
    """
    if depth > 6:
        return False
    if isinstance(value, float):
        return _long(value)
    if isinstance(value, (bool, int, str, bytes)) or value is None:
        return False
    mod = type(value).__module__.split(".")[0]
    if mod == "numpy":
        import numpy as np

        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.floating):
            return False
        return any(_long(float(x)) for x in arr.ravel()[:MAX_ELEMENTS])
    if mod == "torch":
        import torch

        if not isinstance(value, torch.Tensor) or not torch.is_floating_point(value):
            return False
        return any(_long(float(x)) for x in value.detach().flatten()[:MAX_ELEMENTS].double().tolist())
    if isinstance(value, dict):
        items = list(value.items())[:MAX_ELEMENTS]
        return any(holds_computed_float(k, depth + 1) or holds_computed_float(v, depth + 1) for k, v in items)
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_computed_float(v, depth + 1) for v in list(value)[:MAX_ELEMENTS])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_computed_float(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value))
    return False


def same_objects(left: object, right: object) -> bool:
    """Whether ``left`` and ``right`` are the same objects, or sequences of the same objects (one computation's
    values, compared with themselves in another order: ``xs == sorted(xs)``).

    >>> xs = [0.1 * 3, 0.2 * 3]
    >>> same_objects(xs, sorted(xs)), same_objects(xs, [0.1 * 3, 0.2 * 3])
    (True, False)
    """
    if left is right:
        return True
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)) and len(left) == len(right):
        return all(a is b for a, b in zip(left, right)) or sorted(map(id, left)) == sorted(map(id, right))
    return False


def _marked(path: str, first: int, last: int) -> bool:
    """Whether lines ``first..last`` of ``path`` (1-based), or the comment line above them, say why exact."""
    above = linecache.getline(path, first - 1).strip()
    return above.startswith(MARK) or any(MARK in linecache.getline(path, n) for n in range(first, last + 1))


def _refuse(where: str, what: str) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(f"{where}: {what}\n")
        return
    raise AssertionError(_refusal(where, what))


def _refusal(where: str, what: str) -> str:
    return (f"{where}: {what} compares computed floats exactly; another machine's SIMD path may move their last "
            f"bit. Compare with a tolerance that says why (pytest.approx(rel=...)), or, where both sides run the "
            f"same operations in the same order, end the line with '{MARK} <why>'")


# ---- assert statements ---------------------------------------------------------------------------------
_seen: list[tuple[str, object, object]] = []  # this assertion's exact comparisons of computed floats


@pytest.hookimpl(tryfirst=True)
def pytest_assertrepr_compare(config, op, left, right):
    if op == "==" and holds_computed_float(left) and holds_computed_float(right) and not same_objects(left, right):
        _seen.append((op, left, right))
    return None


def pytest_assertion_pass(item, lineno, orig, expl):
    if not _seen:
        return
    _seen.clear()
    path = str(item.path)
    # lineno is the assert's first line (1-based); the statement spans what its source spans
    if not _marked(path, lineno, lineno + orig.count("\n") + 2):
        _refuse(f"{item.path.name}:{lineno}", f"'assert {orig}'")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _seen.clear()  # what a failing assertion left (its test failed anyway)
    _passing[0] = False
    yield


# With the pass hook on, pytest builds a passing assertion's whole explanation (a repr of every operand, the
# diff of every comparison by every pytest_assertrepr_compare hook) only to hand it to pytest_assertion_pass,
# which reads none of it: that was a fifth of the suite's time and thirty times a hypothesis test's. While a
# passing assertion's explanation is built (pytest asks _check_if_assertion_pass_impl first, and
# _call_assertion_pass last, on that branch only), operands are not repr'd and only this file's comparison check
# runs; a failing assertion's message is pytest's own. No pytest option does this; it leans on three helpers of
# pytest's rewriter, and where a release renames them it is simply not installed (the check runs as before).
_passing = [False]


def install_quick_passing_explanations() -> None:
    from _pytest.assertion import rewrite

    names = ("_check_if_assertion_pass_impl", "_saferepr", "_call_reprcompare", "_call_assertion_pass")
    if not all(callable(getattr(rewrite, n, None)) for n in names) or hasattr(rewrite._saferepr, "__wrapped__"):
        return
    has_hook, saferepr, reprcompare, call_pass = (getattr(rewrite, n) for n in names)

    def check_pass() -> bool:
        _passing[0] = has_hook()
        return _passing[0]

    @functools.wraps(saferepr)
    def quick_repr(obj):
        return "" if _passing[0] else saferepr(obj)

    def quick_reprcompare(ops, results, expls, each_obj):
        if not _passing[0]:
            return reprcompare(ops, results, expls, each_obj)
        i = len(ops) - 1  # every comparison of a passing chain held: pytest explains its last
        pytest_assertrepr_compare(None, ops[i], each_obj[i], each_obj[i + 1])
        return expls[i]

    def quick_call_pass(lineno, orig, expl):
        _passing[0] = False
        call_pass(lineno, orig, expl)

    rewrite._check_if_assertion_pass_impl = check_pass
    rewrite._saferepr = quick_repr
    rewrite._call_reprcompare = quick_reprcompare
    rewrite._call_assertion_pass = quick_call_pass


# ---- equality functions --------------------------------------------------------------------------------
def _checked(fn, name: str):
    @functools.wraps(fn)
    def check(a, b, *args, **kwargs):
        result = fn(a, b, *args, **kwargs)
        frame = sys._getframe(1)
        path = frame.f_code.co_filename
        if path.startswith(str(TESTS)) and result is not False and holds_computed_float(a) \
                and holds_computed_float(b) and not same_objects(a, b) and not _marked(path, frame.f_lineno,
                                                                                      frame.f_lineno):
            _refuse(f"{Path(path).name}:{frame.f_lineno}", name)
        return result

    return check


def install_equality_checks() -> None:
    """Wrap the array equality functions tests call (once per process)."""
    import numpy as np
    import torch

    if getattr(torch.equal, "__wrapped__", None) is not None:
        return
    torch.equal = _checked(torch.equal, "torch.equal")
    np.array_equal = _checked(np.array_equal, "np.array_equal")
    np.testing.assert_array_equal = _checked(np.testing.assert_array_equal, "np.testing.assert_array_equal")
    np.testing.assert_equal = _checked(np.testing.assert_equal, "np.testing.assert_equal")
