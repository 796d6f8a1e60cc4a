"""Running a learner's code under a bound, and refusing the package's own code as the learner's:
what every grader of the course (the chapter modules, ``chNN_*.py``, over ``harness``) builds on.

- ``run_bounded(fn, *args, timeout_s=None, case="...", references=(), what=None, **kwargs)``:
  ``fn(*args, **kwargs)``'s result. Past ``timeout_s`` seconds (``TIMEOUT_S`` when None, read at the
  call, so a test can lower it) it raises ``TooSlow`` naming ``case`` and ``what``, and stops ``fn``
  where it can: see below. ``what`` is how every message names the learner's code (default: ``fn``'s
  name; a grader that drives that code through a helper of its own says "code"). An exception of
  ``fn``'s goes through as the learner's own (its type, its traceback), with a note naming the case
  that raised it; one that would end the grader itself (``SystemExit``, ``KeyboardInterrupt``: not an
  ``Exception``) becomes ``Exited``, which names it as the learner's. A call, during ``fn``, into the code of one of ``references`` (functions, classes,
  methods: the package's answer to the exercise) raises ``PackageCode``: a learner's function that
  wraps the package's is refused.
- ``refuse_package_code(learner_obj, *references)``: raises ``PackageCode`` when ``learner_obj``
  is one of ``references``, wraps one (``__wrapped__``, ``functools.partial``, a bound method, a
  ``@triton.jit`` function), subclasses one, or reuses one's code (a method copied into a class).
- ``Bounded(obj, case=..., references=...)``: a learner's object (an instance of their class)
  whose every method call, and every property read, runs through ``run_bounded``; ``case`` can be
  changed between calls. What it answers comes back as plain values (``as_answer``).
- ``plain(x)``, ``plain_tensor(x)``, ``as_answer(x)``: a learner's answer as builtins, a plain tensor,
  or an ``Opaque`` stand-in, read without running its code: a grader compares values, never the
  learner's objects, whose ``__eq__`` could say equal (or keep the answer it was compared with).

Why a thread and not ``signal.setitimer``: a Jupyter kernel runs a cell in its main thread, where an
alarm would work, but a grader may run anywhere (a test's worker thread, a server, Windows, where
there is no ``SIGALRM``), and the alarm's handler would replace whatever the kernel or pytest set.
A daemon thread works in every case; the caller waits ``timeout_s`` for it, then stops it with an
asynchronous exception (CPython's ``PyThreadState_SetAsyncExc``), which ends a Python loop at its
next bytecode. Code stuck inside one C call finishes that call first (the thread is a daemon: it
never holds the process open). The time bound is a guard against code that never returns, never a
verdict on speed: it is generous (``TIMEOUT_S``).
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import sys
import threading

import numpy as np
import torch

TIMEOUT_S = 20.0


class TooSlow(AssertionError):
    """The learner's code did not return within its bound."""


class PackageCode(AssertionError):
    """The learner's answer is (or calls) the package's own answer to the exercise."""


class Exited(AssertionError):
    """The learner's code raised what would end the grader (``sys.exit``, ``KeyboardInterrupt``)."""


class _Stopped(BaseException):
    """Raised inside a learner's thread that ran past its bound (a BaseException: ``except
    Exception`` in the learner's loop does not swallow it)."""


def describe(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _where(obj) -> str:
    inner = _unwrapped(obj)[-1]           # a Triton jit's module is its function's, not Triton's
    return f"{getattr(inner, '__module__', '?')}.{describe(obj)}"


def _unwrapped(obj):
    """``obj`` and what it wraps: ``__wrapped__`` chains, partials, bound methods, Triton's ``fn``."""
    seen = []
    while obj is not None and not any(obj is s for s in seen):
        seen.append(obj)
        obj = (getattr(obj, "__wrapped__", None) or (obj.func if isinstance(obj, functools.partial) else None)
               or getattr(obj, "__func__", None) or getattr(obj, "fn", None))
    return seen


def _functions(obj):
    """The plain functions ``obj`` is made of: itself, or a class's methods (properties included)."""
    out = []
    for o in _unwrapped(obj):
        if inspect.isclass(o):
            for attr in vars(o).values():
                attr = attr.fget if isinstance(attr, property) else attr
                out += [f for f in _unwrapped(attr) if inspect.isfunction(f)]
        elif inspect.isfunction(o):
            out.append(o)
    return out


def code_objects(references) -> dict:
    """Code object -> the reference it belongs to, for ``references``' functions and methods."""
    return {f.__code__: ref for ref in references for f in _functions(ref)}


def refuse_package_code(learner_obj, *references):
    """Raise ``PackageCode`` if ``learner_obj`` is, wraps, subclasses, copies or names (calls) one of
    ``references``."""
    codes = code_objects(references)
    for obj in _unwrapped(learner_obj):
        for ref in references:
            if obj is ref or (inspect.isclass(obj) and inspect.isclass(ref) and issubclass(obj, ref)):
                kind = "is" if obj is ref else "subclasses"
                raise PackageCode(f"your {describe(learner_obj)} {kind} the package's own {_where(ref)}: "
                                  "the grader compares your code with it; write your own")
        for f in _functions(obj):
            if f.__code__ in codes:
                raise PackageCode(f"your {describe(learner_obj)} reuses the code of the package's own "
                                  f"{_where(codes[f.__code__])} ({f.__name__}): write your own")
            named = _named(f, references)
            if named is not None:
                raise PackageCode(f"your {describe(learner_obj)} calls the package's own {_where(named)} "
                                  f"({f.__name__}): the grader compares your code with it; write your own")


def _named(f, references):
    """The reference ``f``'s code names, as a global or an attribute of a global module (a Triton
    ``@jit`` body calls what it names: no profile hook sees that call), or None."""
    found = [f.__globals__.get(name) for name in f.__code__.co_names]
    found += [getattr(m, name, None) for m in found if inspect.ismodule(m) for name in f.__code__.co_names]
    return next((ref for ref in references for g in found for o in _unwrapped(g) if o is ref), None)


def interrupt(ident: int, exc=_Stopped):
    """Raise ``exc`` in thread ``ident`` at its next bytecode; None cancels one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc))


def _stop(thread: threading.Thread):
    interrupt(thread.ident)
    thread.join(1.0)


PROGRESS = "a request leaves, a batch returns, an index grows"     # what a step of a course loop does


def run_bounded(fn, *args, timeout_s: float | None = None, case: str = "", references=(), what: str | None = None,
                progress: str = PROGRESS, **kwargs):
    """``fn(*args, **kwargs)`` in a thread bounded by ``timeout_s``, watched for calls into
    ``references``' code (module docstring); ``progress``: what each step of the learner's code must
    do, said when it runs past the bound."""
    codes, box = code_objects(references), {}
    timeout_s, what = TIMEOUT_S if timeout_s is None else timeout_s, what or describe(fn)

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes and "hit" not in box:
            box["hit"] = codes[frame.f_code]

    def target():
        if codes:
            sys.setprofile(watch)
        try:
            box["value"] = fn(*args, **kwargs)
        except _Stopped:
            pass
        except BaseException as e:          # noqa: BLE001  (the learner's, shown as theirs below)
            box["error"] = e
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=target, name=f"learner {describe(fn)}", daemon=True)
    thread.start()
    try:
        thread.join(timeout_s)
    except BaseException:                   # the kernel interrupted (Ctrl-C): the learner's code stops too
        _stop(thread)
        raise
    if thread.is_alive():
        _stop(thread)
        raise TooSlow(f"your {what} did not return within {timeout_s:g} s on {case}: a loop that never "
                      f"ends? (each step must make progress: {progress})")
    if "hit" in box:
        raise PackageCode(f"your {what} called the package's own {_where(box['hit'])} on {case}: "
                          "the grader compares your code with it; write your own")
    if "error" in box:
        e = box["error"]
        if not isinstance(e, Exception):    # SystemExit, KeyboardInterrupt: a notebook would read them as its own
            raise Exited(f"your {what} raised {type(e).__name__}({e}) on {case}: code under a grader must "
                         "return or raise an ordinary exception, not exit or interrupt") from None
        e.add_note(f"(raised by your {what} on {case})")
        tb = e.__traceback__
        raise e.with_traceback(tb.tb_next if tb is not None and tb.tb_next is not None else tb)
    return box["value"]


class Bounded:
    """The learner's object (a class's instance) whose every method call, and every property read,
    goes through ``run_bounded``, with ``case`` (settable as the grading goes on) and ``references``;
    its other attributes read through. What it answers is read as plain values (``plain``), or else
    as ``Opaque``: an object of the learner's never compares itself with the package's answer."""

    def __init__(self, obj, case: str = "", references=(), timeout_s: float | None = None):
        vars(self).update(obj=obj, case=case, references=references, timeout_s=timeout_s)

    def __getattr__(self, name):
        if isinstance(inspect.getattr_static(self.obj, name, None), property):   # the learner's code too
            return as_answer(run_bounded(getattr, self.obj, name, timeout_s=self.timeout_s, case=self.case,
                                       references=self.references, what=f"property {name}"))
        attr = getattr(self.obj, name)
        if not callable(attr):
            return as_answer(attr)
        return lambda *args, **kwargs: as_answer(run_bounded(attr, *args, timeout_s=self.timeout_s, case=self.case,
                                                           references=self.references, **kwargs))


PLAIN_DEPTH = 8       # nesting a plain answer may have (a list of lists ...): deeper is no answer here


def plain(x, depth: int = PLAIN_DEPTH):
    """``x`` as builtins of their exact types (int, float, str, bytes, bool, None; lists for any
    sequence, numpy's and torch's included; tuples as lists; dicts and sets), read without running
    any code of ``x``'s own: a subclass's ``__eq__``, ``__iter__`` or ``__int__`` never runs, so the
    grader compares values, not the learner's objects. Anything else is a ``TypeError`` naming its type."""
    if depth < 0:
        raise TypeError(f"nested more than {PLAIN_DEPTH} deep")
    if x is None or isinstance(x, (bool, np.bool_)):
        return None if x is None else bool(x)
    for kind in (int, float, str, bytes):
        if isinstance(x, kind):
            return getattr(kind, "__index__" if kind is int else f"__{kind.__name__}__")(x)   # the builtin's own
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return plain_tensor(x).tolist() if isinstance(x, torch.Tensor) else np.ndarray.tolist(x)
    if isinstance(x, (list, tuple, range)):        # (range: a builtin no class extends)
        return [plain(v, depth - 1) for v in (list.__iter__(x) if isinstance(x, list) else tuple.__iter__(x)
                                              if isinstance(x, tuple) else x)]
    if isinstance(x, dict):
        return {_hashable(plain(k, depth - 1)): plain(v, depth - 1) for k, v in dict.items(x)}
    if isinstance(x, (set, frozenset)):
        return {_hashable(plain(v, depth - 1)) for v in (frozenset.__iter__ if isinstance(x, frozenset) else set.__iter__)(x)}
    raise TypeError(f"of type {type(x).__name__}, not a plain value (a number, a string, a list or dict of them)")


def listed(x) -> list:
    """A learner's sequence as a list of plain values: a plain one read without its code (``plain``),
    any other iterable (a generator) walked, which runs its code: read it under a bound."""
    try:
        got = plain(x)
    except TypeError:
        got = plain(list(x))
    if not isinstance(got, list):
        raise TypeError(f"a {type(x).__name__}, not a sequence")
    return got


def an_int(x) -> int:
    """``x`` as an exact int: a Python or numpy integer, or a 0-d integer tensor; never a float
    (``int()`` would truncate 2.9), a bool or a string (``int()`` would read "10 ")."""
    got = plain(x)
    if type(got) is not int:
        raise TypeError(f"{got!r} ({type(x).__name__}) is no integer")
    return got


def a_number(x) -> float:
    """``x`` as a float: a Python or numpy int or float, or a 0-d tensor of them; never a bool
    or a string (``float()`` would read "286.03" and True as numbers)."""
    got = plain(x)
    if type(got) not in (int, float):
        raise TypeError(f"{got!r} ({type(x).__name__}) is no number")
    return float(got)


def ints(xs) -> list[int]:
    """``listed(xs)``, each an exact int (``an_int``)."""
    return [an_int(v) for v in listed(xs)]


def _hashable(x):
    """A plain key as it was hashable: a tuple (made a list by ``plain``) a tuple again."""
    return tuple(map(_hashable, x)) if isinstance(x, list) else x


def plain_tensor(x) -> torch.Tensor:
    """A learner's tensor as a plain ``torch.Tensor``, its subclass (and the ``__torch_function__`` that
    could answer ``torch.equal`` for it) stripped without running its code; anything else through
    ``torch.as_tensor`` (run that under a bound: a learner's sequence runs its own code when read)."""
    if not isinstance(x, torch.Tensor):
        return torch.as_tensor(x)
    return torch.Tensor.as_subclass(x, torch.Tensor)     # (torch dispatches no __torch_function__ for it)


class Opaque:
    """What a learner's method answered that is no plain value: equal to nothing but itself, shown
    by its type (its own ``__eq__`` and ``__repr__`` never run)."""

    def __init__(self, of):
        self.type = type(of).__name__

    def __repr__(self):
        return f"<a {self.type}>"


def as_answer(x):
    """``plain(x)``, or an ``Opaque`` of it: what a grader may compare with the package's answer."""
    try:
        return plain(x)
    except TypeError:
        return Opaque(x)
