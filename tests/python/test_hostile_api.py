"""Property-based (Hypothesis) test of the public numpy API with hostile input (issue 27):
wrong types, wrong dtypes and shapes, non-contiguous and zero-size arrays, huge or negative
sizes, NaN and inf in optimizer state, names with ``/``, ``..``, NUL and non-UTF-8 (lone
surrogates), metadata that is not JSON, and a checkpoint closed, replaced or deleted while
arrays from it are alive.

The rule: every call returns or raises a ``ckptstore.CheckpointError`` subclass (a
``TypeError`` is accepted only where an argument has the wrong *Python type*, the
ordinary Python convention the docs do not override); never a segfault, a hang, another
exception, or a changed checkpoint. After every failing save / write_part / commit, the
checkpoint previously committed in that directory is unchanged bit for bit, opens and
verifies.

Each property runs in a child process (this file run as a script, ``derandomize=True`` so
that every run draws the same examples) under a timeout, so that a segfault or a hang
fails the test with the example that caused it (the child writes each example to a file
before running it) instead of killing pytest.

Found and fixed (``test_fixed_findings`` keeps them fixed; the properties no longer keep
them out). In the bindings (python/src/args.rs):
a closed ``Checkpoint`` raised a plain ``ValueError`` (now ``InvalidArgumentError``, still a
``ValueError``); a tensor name with a lone surrogate raised ``UnicodeEncodeError`` (now
``TensorNotFoundError``: stored names are UTF-8, and ``in`` is ``False``); a negative or
>= 2**64 offset or shape in ``read_region``, ``copy_ranges_into_unchecked``,
``verify_regions`` and ``read_into`` raised ``OverflowError`` (now
``InvalidArgumentError``); ``Chunk.__repr__`` raised ``ValueError`` for a ragged-list array.
In ``ckptstore.torch.save``: a negative or >= 2**64 ``max_shard_size`` raised
``OverflowError`` (now ``InvalidArgumentError``), a tensor in ``extra`` under a key with a lone
surrogate ``UnicodeEncodeError`` (now ``InvalidArgumentError``, for any value under such a key;
a tensor name that is not UTF-8 is ``InvalidTensorError``), a meta-device tensor torch's
``NotImplementedError`` (now ``InvalidTensorError``).

Found and fixed: metadata nested 127 levels deep (an optimizer hyperparameter 123-124
levels deep) was accepted by ``save`` (and ``CheckpointManager.save``), committed, and the
new manifest then exceeded serde_json's recursion limit: the checkpoint that replaced the
old one could not be opened. Writers now refuse user JSON nested deeper than
``format::MAX_JSON_DEPTH`` (64 levels, format-spec/manifest.md §Limits) before writing
anything; ``test_deep_json_is_refused_before_anything_changes`` keeps it so.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
EXAMPLES = int(os.environ.get("CKPT_HOSTILE_EXAMPLES", "0")) or None  # per property

# ------------------------------------------------------------------------------------
# The child side: the properties themselves
# ------------------------------------------------------------------------------------


def _child(prop: str, workdir: str, last_path: str) -> None:  # noqa: C901 - one scope on purpose
    import faulthandler

    faulthandler.enable()
    import ml_dtypes
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import ckptstore
    import ckptstore.torch
    from ckptstore import CheckpointError, Chunk, F16Scaled

    import collections

    work = Path(workdir)
    counter = [0]
    outcomes: collections.Counter = collections.Counter()

    def fresh(tag: str) -> Path:
        counter[0] += 1
        return work / f"{tag}-{counter[0]}"

    def note(*what) -> None:
        counter.append(1)
        # The example about to run, for the parent to show if the child dies.
        with open(last_path, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(safe_repr(what)[:20000])

    def safe_repr(x, depth: int = 0) -> str:
        # Chunk.__repr__ shows only the shape: show the array's contents too.
        if depth > 30:
            return "..."
        if isinstance(x, Chunk):
            return (f"Chunk(array={safe_repr(x.array, depth + 1)}, "
                    f"global_shape={x.global_shape!r}, offsets={x.offsets!r})")
        if isinstance(x, dict):
            return "{" + ", ".join(f"{safe_repr(k, depth + 1)}: {safe_repr(v, depth + 1)}"
                                   for k, v in x.items()) + "}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(safe_repr(v, depth + 1) for v in x) + "]"
        try:
            return repr(x)
        except Exception as e:  # noqa: BLE001
            return f"<{type(x).__name__}: repr raised {e!r}>"

    SET = settings(
        derandomize=True,
        deadline=None,
        database=None,
        max_examples=EXAMPLES or MAX_EXAMPLES[prop],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )

    # -- strategies ------------------------------------------------------------------
    BAD_CHARS = ["/", "..", "\x00", "\udcff", "\ud800", "\\", "\n", " ", "é", "\u202e", "optim/", "__metadata__", ".scale"]
    names = st.one_of(
        st.sampled_from(["w", "", ".", "..", "/", "a/../b", "../../etc/passwd", "a\x00b", "\udcff",
                         "x" * 5000, "__metadata__", "optim/w/exp_avg", "w.scale", "ck/..\\x"]),
        st.lists(st.one_of(st.sampled_from(BAD_CHARS), st.text(max_size=3)), max_size=5).map("".join),
    )
    DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
              np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
              ">f4", ">i8", np.complex64, np.object_, "U3", "S2", "M8[s]", "i4,f4", np.float128
              if hasattr(np, "float128") else np.complex128]
    shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)

    @st.composite
    def arrays(draw):
        dt = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = draw(shapes)
        n = int(np.prod(shape, dtype=np.int64))
        if dt.kind in "fc" or dt.name == "bfloat16":
            vals = np.array(draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, np.nan, np.inf, -np.inf, 6.5e4, 1e-8]),
                                          min_size=n, max_size=n)), np.float64)
            a = vals.astype(dt) if dt.kind != "c" else vals.astype(dt)
        elif dt.kind in "biu":
            a = (np.arange(n) * 37 % 251).astype(dt)
        else:
            a = np.zeros(n, dt)
        a = a.reshape(shape)
        view = draw(st.sampled_from(["plain", "T", "rev", "step", "fortran", "bytes_view", "0d", "broadcast"]))
        if view == "T":
            a = a.T
        elif view == "rev" and a.ndim:
            a = a[::-1]
        elif view == "step" and a.ndim:
            a = a[::2]
        elif view == "fortran":
            a = np.asfortranarray(a)
        elif view == "bytes_view" and a.ndim and a.dtype.itemsize > 1 and a.dtype.kind in "biuf":
            a = a.view(np.uint8)
        elif view == "0d":
            a = np.asarray(a.reshape(-1)[:1].reshape(())) if a.size else a
        elif view == "broadcast" and a.ndim:
            a = np.broadcast_to(a, (2,) + a.shape)
        return a

    python_values = st.sampled_from([None, 1, 1.5, True, "str", b"bytes", [1, 2], [[1], [2, 3]], {"a": 1},
                                     object(), 2 ** 70, -(2 ** 70), float("nan"), [1.0, float("inf")],
                                     np.float32(3), np.int64(-1), np.bool_(True), memoryview(b"ab")])
    values = st.one_of(arrays(), python_values)
    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=4),
                          st.sampled_from([b"x", {1, 2}, object(), np.float32(1), "\udcff", float("nan")]))
    json_like = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(st.one_of(st.text(max_size=3), st.integers(), st.just("\udcff"), st.none()), c, max_size=3)),
                             max_leaves=8)
    def nested(depth: int, leaf="x"):
        v = leaf
        for i in range(depth):
            v = {"k": v} if i % 2 else [v]
        return v

    # Around the writers' limit (64) and serde_json's (128, where a manifest once failed to
    # open after its save had committed it).
    deep = st.sampled_from([1, 50, 62, 63, 64, 65, 125, 126, 127, 128, 129, 200, 5000]).map(lambda n: {"deep": nested(n)})
    metadata = st.one_of(st.none(), json_like, deep,
                         st.dictionaries(st.text(max_size=4), json_like, max_size=3))
    sizes = st.one_of(st.none(), st.sampled_from([0, -1, 1, 7, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 2 ** 70, -(2 ** 64), True]),
                      st.integers(-10, 100), st.sampled_from([1.5, "8", float("nan"), float("inf"), np.int64(16), np.uint64(2 ** 63)]))
    opt_state_vals = st.one_of(arrays(), python_values,
                               st.builds(lambda q, s: F16Scaled(q, s), arrays(), arrays()))
    optimizers = st.one_of(
        st.none(),
        python_values,
        st.fixed_dictionaries(
            {"param_groups": st.one_of(python_values, st.lists(st.one_of(python_values, st.fixed_dictionaries(
                {"params": st.one_of(python_values, st.lists(st.one_of(names, python_values), max_size=3))},
                optional={"lr": json_leaf, "betas": st.lists(json_leaf, max_size=2),
                          "deep": st.sampled_from([1, 60, 62, 63, 64, 121, 123, 124, 125, 126, 300, 5000]).map(nested)})),
                max_size=3))},
            optional={
                "param_shapes": st.one_of(python_values, st.dictionaries(names, st.one_of(python_values, shapes, st.lists(st.integers(-2 ** 65, 2 ** 65), max_size=3)), max_size=3)),
                "state": st.one_of(python_values, st.dictionaries(names, st.one_of(python_values, st.dictionaries(names, opt_state_vals, max_size=3)), max_size=3)),
            },
        ),
    )

    # -- the rule --------------------------------------------------------------------
    def acceptable(exc: BaseException, type_errors_ok: bool) -> bool:
        if isinstance(exc, CheckpointError):
            return True
        if type_errors_ok and type(exc) is TypeError:
            return True
        return False

    def call(f, *, type_errors_ok: bool):
        """``(True, result)`` or ``(False, exception)``; anything else fails."""
        try:
            r = f()
            outcomes["returned"] += 1
            return True, r
        except BaseException as e:  # noqa: BLE001 - the property is about exceptions
            outcomes[type(e).__name__] += 1
            if not acceptable(e, type_errors_ok):
                raise AssertionError(
                    f"raised {type(e).__module__}.{type(e).__name__}: {e}\n"
                    + "".join(traceback.format_exception(e))
                ) from None
            return False, e

    def snapshot(d: Path) -> dict:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    def assert_unchanged(d: Path, before: dict, expect: dict) -> None:
        after = snapshot(d)
        for name, data in before.items():
            assert after.get(name) == data, f"committed file {name} changed or vanished"
        assert set(after) == set(before), f"files left behind: {sorted(set(after) - set(before))}"
        with ckptstore.open(d) as ck:
            ck.verify()
            assert sorted(ck.keys()) == sorted(expect)
            for k, v in expect.items():
                assert ck[k].tobytes() == v.tobytes() and ck[k].dtype == v.dtype

    BASE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int64(10),
            "empty": np.zeros((0, 3), np.float16), "bf": np.ones(5, ml_dtypes.bfloat16)}
    template = work / "template"
    ckptstore.save(template, BASE, metadata={"run": "base"})

    def based(tag: str) -> tuple[Path, dict]:
        d = fresh(tag)
        shutil.copytree(template, d)
        return d, snapshot(d)

    def check_saved(d: Path, tensors: dict) -> None:
        with ckptstore.open(d) as ck:
            ck.verify()
            keys = set(ck.keys())
            assert set(tensors) <= keys, (sorted(tensors), sorted(keys))
            assert all(k.startswith("optim/") for k in keys - set(tensors)), sorted(keys)
            for k, v in tensors.items():
                want = np.array(v, order="C")  # keeps 0-dim arrays 0-dim
                want = want.astype(want.dtype.newbyteorder("="))
                got = ck[k]
                assert got.shape == want.shape, (k, got.shape, want.shape)
                assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
                assert got.tobytes() == want.tobytes(), k

    # -- properties ------------------------------------------------------------------
    @SET
    @given(st.dictionaries(names, values, max_size=4), metadata, sizes, optimizers,
           st.sampled_from(["inline", "background", "bogus", 3, None]))
    def save_hostile(tensors, meta, mss, opt, cleanup):
        d, before = based("save")
        note("save", tensors, meta, mss, opt, cleanup)
        kw = {"metadata": meta, "max_shard_size": mss, "optimizer": opt}
        if cleanup is not None:
            kw["cleanup"] = cleanup
        ok, r = call(lambda: ckptstore.save(d, tensors, **kw), type_errors_ok=True)
        ckptstore.wait_for_cleanup()
        if ok:
            check_saved(d, tensors)
        else:
            assert_unchanged(d, before, BASE)
        shutil.rmtree(d)

    @SET
    @given(st.one_of(st.dictionaries(names, arrays(), max_size=4)), metadata, sizes)
    def save_right_types(tensors, meta, mss):
        # Every argument of the right Python type: only CheckpointError may come out.
        if not (meta is None or isinstance(meta, dict)):
            meta = {"m": meta}
        if not (mss is None or isinstance(mss, (int, np.integer))):
            mss = None
        d, before = based("typed")
        note("save_right_types", tensors, meta, mss)
        ok, r = call(lambda: ckptstore.save(d, tensors, metadata=meta, max_shard_size=mss), type_errors_ok=False)
        if ok:
            check_saved(d, tensors)
        else:
            assert_unchanged(d, before, BASE)
        shutil.rmtree(d)

    # The reader: a checkpoint with every kind of tensor and optimizer state.
    rdir = work / "reader"
    ckptstore.save(rdir, BASE, optimizer={
        "param_groups": [{"params": ["w"], "lr": 1e-3}],
        "state": {"w": {"step": np.float32(3), "exp_avg": np.full((3, 4), np.nan, np.float32),
                        "exp_avg_sq": F16Scaled(np.full((3, 4), np.inf, np.float16), np.float32(2.0))}}})
    rbefore = snapshot(rdir)
    ints = st.one_of(st.integers(-3, 14), st.sampled_from([2 ** 63, 2 ** 64 - 1]))
    layouts = st.one_of(st.none(), st.sampled_from(["as_stored", "f32", "bf16", "f16_scaled", "f16_scaled_scalar",
                                                   "f16_scaled_one", "float32", "bogus", ""]),
                        st.dictionaries(st.one_of(names, st.tuples(names, names), st.just("*")),
                                        st.sampled_from(["f32", "bf16", "f16_scaled", "nope"]), max_size=3),
                        python_values)
    read_names = st.one_of(st.sampled_from(["w", "step", "empty", "bf", "optim/w/exp_avg", "optim/w/exp_avg_sq.scale"]),
                           names)

    @SET
    @given(st.lists(st.tuples(st.sampled_from(["getitem", "get", "info", "chunks", "contains", "read", "region", "opt", "keys"]),
                              read_names, st.lists(ints, max_size=3), st.lists(ints, max_size=3), layouts,
                              st.booleans()), min_size=1, max_size=6))
    def read_hostile(ops):
        note("read", ops)
        with ckptstore.open(rdir) as ck:
            for op, name, offs, shape, layout, flag in ops:
                if op == "getitem":
                    call(lambda: ck[name], type_errors_ok=False)
                elif op == "get":
                    call(lambda: ck.get(name, verify=flag, raw=not flag), type_errors_ok=False)
                elif op == "info":
                    call(lambda: ck.info(name), type_errors_ok=False)
                elif op == "chunks":
                    call(lambda: ck.chunks(name), type_errors_ok=False)
                elif op == "contains":
                    call(lambda: name in ck, type_errors_ok=False)
                elif op == "read":
                    call(lambda: ck.read([name, "w"], verify=flag), type_errors_ok=False)
                elif op == "region":
                    ok, r = call(lambda: ck.read_region(name, offs, shape), type_errors_ok=False)
                    if ok and name == "w":
                        w = BASE["w"]
                        box = tuple(slice(o, o + s) for o, s in zip(offs, shape))
                        np.testing.assert_array_equal(r, w[box])
                elif op == "opt":
                    call(lambda: ck.load_optimizer(layout, raw=flag), type_errors_ok=not isinstance(layout, (str, dict, type(None))))
                else:
                    assert ck.keys() and ck.metadata is not None
        assert snapshot(rdir) == rbefore

    @SET
    @given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=8),
           st.sampled_from([np.float32, np.float16, np.float64, ml_dtypes.bfloat16]),
           st.floats(allow_nan=True, allow_infinity=True, width=32), layouts)
    def optimizer_nan_inf(vals, dt, scale, layout):
        p = np.zeros(len(vals), np.float32)
        m = np.array(vals, np.float32).astype(dt)
        q = np.array(vals, np.float32).astype(np.float16)
        d = fresh("opt")
        opt = {"param_groups": [{"params": ["p"], "lr": 0.1}],
               "state": {"p": {"step": np.float32(scale), "exp_avg": m,
                               "exp_avg_sq": F16Scaled(q, np.array([scale], np.float32))}}}
        note("optimizer_nan_inf", vals, dt, scale, layout)
        ok, _ = call(lambda: ckptstore.save(d, {"p": p}, optimizer=opt), type_errors_ok=False)
        if not ok:
            return
        with ckptstore.open(d) as ck:
            ck.verify()
            st_ = ck.load_optimizer()["state"]["p"]
            assert st_["exp_avg"].tobytes() == m.tobytes()
            assert st_["exp_avg_sq"].q.tobytes() == q.tobytes()
            call(lambda: ck.load_optimizer(layout), type_errors_ok=not isinstance(layout, (str, dict, type(None))))
        shutil.rmtree(d)

    @SET
    @given(st.lists(st.tuples(names, st.one_of(arrays(), python_values), st.lists(ints, max_size=3),
                              st.lists(ints, max_size=3), st.booleans()), max_size=3),
           st.one_of(st.integers(-2, 3), st.sampled_from([2 ** 32, 2 ** 64, -(2 ** 40), "0", None, 1.0])),
           st.sampled_from(["fresh", "bad", "", "0" * 32, "A" * 32, "\x00" * 32, "\ud800" * 32, None, 7]), sizes, metadata)
    def parts_hostile(items, rank, cid, mss, meta):
        d, before = based("parts")
        cid = ckptstore.new_checkpoint_id() if cid == "fresh" else cid
        tensors = {}
        for name, v, offs, gshape, as_chunk in items:
            tensors[name] = Chunk(v, gshape, offs) if as_chunk else v
        note("parts", tensors, rank, cid, mss, meta)
        ok, part = call(lambda: ckptstore.write_part(d, cid, rank, tensors, max_shard_size=mss), type_errors_ok=True)
        # Nothing is committed by write_part: the old checkpoint stays, whatever happened.
        with ckptstore.open(d) as ck:
            ck.verify()
            assert sorted(ck.keys()) == sorted(BASE)
        parts = [part] if ok else [b"\x00garbage", b""]
        ok2, _ = call(lambda: ckptstore.commit(d, cid, parts=parts, world_size=1 if ok else None,
                                               metadata=meta), type_errors_ok=True)
        if not ok2:
            for k, v in before.items():
                assert (d / k).read_bytes() == v, f"{k} changed by a failing commit"
            with ckptstore.open(d) as ck:
                ck.verify()
                assert ck.metadata == {"run": "base"}
        shutil.rmtree(d)

    @SET
    @given(st.lists(st.sampled_from(["take", "take_view", "take_read", "close", "resave", "resave_other", "rmtree", "reopen",
                                     "del", "gc", "call_closed"]), min_size=1, max_size=10))
    def lifetime(actions):
        d = fresh("life")
        w0 = np.arange(4096, dtype=np.float32).reshape(64, 64)
        ckptstore.save(d, {"w": w0, "z": np.zeros(0, np.int8), "s": np.float64(np.nan)})
        ck = ckptstore.open(d)
        held: list[tuple[np.ndarray, bytes]] = []
        note("lifetime", actions)
        gen = 0
        for a in actions:
            if a in ("take", "take_view", "take_read") and ck is not None and not ck.closed:
                if a == "take_read":
                    got = list(ck.read(verify=True).values()) + [ck.get(k, raw=True) for k in ck.keys()]
                else:
                    got = [ck[k] for k in ck.keys()]
                for arr in got:
                    if a == "take_view" and arr.ndim:
                        arr = arr[1::3, ::-2] if arr.ndim == 2 else arr[::-1]
                    held.append((arr, arr.tobytes()))
            elif a == "close" and ck is not None:
                ck.close()
            elif a in ("resave", "resave_other"):
                gen += 1
                other = {"w": np.full((64, 64), gen, np.float32)} if a == "resave" else {"q": np.ones(3, np.uint8)}
                ckptstore.save(d, other)
            elif a == "rmtree":
                shutil.rmtree(d, ignore_errors=True)
            elif a == "reopen":
                ok, r = call(lambda: ckptstore.open(d), type_errors_ok=False)
                ck = r if ok else ck
            elif a == "del":
                ck = None
            elif a == "gc":
                gc.collect()
            elif a == "call_closed" and ck is not None and ck.closed:
                for f in (lambda: ck["w"], ck.keys, ck.verify, lambda: ck.metadata, lambda: ck.info("w"),
                          lambda: ck.read(), lambda: ck.get("w"), lambda: ck.read_region("w", [0, 0], [1, 1]),
                          ck.load_optimizer, lambda: ck.chunks("w"), lambda: len(ck), lambda: "w" in ck):
                    try:
                        f()
                    except CheckpointError:
                        pass
                    else:
                        raise AssertionError("a closed checkpoint answered")
                ck.close()  # idempotent
            for arr, data in held:
                assert arr.tobytes() == data, f"a held array changed after {a}"
        if ck is not None:
            ck.close()
        shutil.rmtree(d, ignore_errors=True)

    @SET
    @given(st.one_of(st.integers(-3, 5), st.sampled_from([2 ** 64, 2 ** 64 - 1, -(2 ** 64), 1.0, "1", None, True])),
           st.one_of(st.none(), st.integers(-2, 3), st.sampled_from([2 ** 70, 1.5, "2", True])),
           st.dictionaries(names, values, max_size=2), metadata)
    def manager_hostile(step, keep, tensors, meta):
        root = fresh("mgr")
        note("manager", step, keep, tensors, meta)
        ok, mgr = call(lambda: ckptstore.CheckpointManager(root, keep_last=keep), type_errors_ok=True)
        if not ok:
            return
        mgr.save(1, BASE)
        before = snapshot(root)
        ok, _ = call(lambda: mgr.save(step, tensors, metadata=meta), type_errors_ok=True)
        if not ok:
            assert snapshot(root) == before
            assert mgr.steps() == [1]
        call(lambda: mgr.lease(step).release(), type_errors_ok=True)
        call(lambda: mgr.step_dir(step), type_errors_ok=True)
        mgr.gc()
        shutil.rmtree(root)

    @SET
    @given(st.one_of(st.sampled_from(["", "\x00", "a\x00b", "\udcff", "/proc/self/mem", "/dev/null", "/", ".",
                                      "../../../../../etc", "x" * 5000, 3, None, b"bytes", 1.5]), names))
    def open_hostile(path):
        note("open", path)
        call(lambda: ckptstore.open(path).close(), type_errors_ok=not isinstance(path, str))

    # The copy primitives under the torch loaders (memory safety: a destination of the
    # wrong size, dtype, layout or writability must be refused, never overrun).
    @st.composite
    def dests(draw):
        n = draw(st.sampled_from([0, 1, 3, 8, 23, 24, 25, 48, 4096]))
        dt = draw(st.sampled_from([np.uint8, np.uint8, np.uint8, np.float32, np.int8]))
        kind = draw(st.sampled_from(["plain", "plain", "strided", "readonly", "2d", "mapped"]))
        if kind == "mapped":
            return mapped_raw
        a = np.zeros(n * (2 if kind == "strided" else 1), dt)
        if kind == "strided":
            a = a[::2]
        elif kind == "readonly":
            a.flags.writeable = False
        elif kind == "2d" and n % 8 == 0 and n:
            a = a.reshape(8, -1)
        return a

    copy_names = st.sampled_from(["w", "step", "empty", "bf", "nope", "", "optim/w/exp_avg"])
    offsets = st.sampled_from([-1, 0, 1, 8, 23, 24, 47, 48, 2 ** 32, 2 ** 64 - 1, 2 ** 64])
    mapped_raw = None

    @SET
    @given(st.lists(st.tuples(st.sampled_from(["copy", "ranges", "fill", "region"]), copy_names, dests(),
                              offsets, st.lists(st.integers(0, 5), max_size=2),
                              st.lists(st.integers(0, 5), max_size=2)), min_size=1, max_size=5))
    def copy_hostile(ops):
        nonlocal mapped_raw
        note("copy", ops)
        with ckptstore.open(rdir) as ck:
            rr = ckptstore._ckptstore.RegionReader(str(rdir))
            for op, name, dst, off, roffs, rshape in ops:
                if dst is None:
                    dst = mapped_raw = ck.get("w", raw=True)
                before = dst.tobytes()
                if op == "copy":
                    ok, _ = call(lambda: ck.copy_into_unchecked([(name, dst)]), type_errors_ok=True)
                    if ok:
                        assert dst.tobytes() == ck.get(name, raw=True).tobytes()
                elif op == "ranges":
                    ok, _ = call(lambda: ck.copy_ranges_into_unchecked([(name, off, dst)]), type_errors_ok=True)
                    if ok:
                        assert dst.tobytes() == ck.get(name, raw=True).tobytes()[off:off + dst.nbytes]
                elif op == "fill":
                    ok, _ = call(lambda: ck.fill_and_verify([(name, dst)], [name]), type_errors_ok=True)
                    if ok:
                        assert dst.tobytes() == ck.get(name, raw=True).tobytes()
                else:
                    ok, _ = call(lambda: rr.read_into([(name, roffs, rshape, dst)]), type_errors_ok=True)
                    if ok and name == "w":
                        box = tuple(slice(o, o + n) for o, n in zip(roffs, rshape))
                        assert dst.tobytes() == BASE["w"][box].tobytes()
                if not ok:
                    assert dst.tobytes() == before, "a refused copy wrote into its destination"
        assert snapshot(rdir) == rbefore

    def torch_hostile():
        import torch

        torch_vals = st.one_of(
            python_values, json_like,
            st.sampled_from(["f32", "f64", "bf16", "i8", "bool", "c64", "nc", "zero", "0d", "nan", "meta"]).map(
                lambda k: {"f32": lambda: torch.arange(6, dtype=torch.float32).reshape(2, 3),
                           "f64": lambda: torch.full((3,), float("nan"), dtype=torch.float64),
                           "bf16": lambda: torch.ones(4, dtype=torch.bfloat16),
                           "i8": lambda: torch.arange(5, dtype=torch.int8),
                           "bool": lambda: torch.tensor([True, False]),
                           "c64": lambda: torch.zeros(2, dtype=torch.complex64),
                           "nc": lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4).t()[::2],
                           "zero": lambda: torch.zeros(0, 4),
                           "0d": lambda: torch.tensor(float("inf")),
                           "nan": lambda: torch.tensor([float("nan"), float("-inf")]),
                           "meta": lambda: torch.empty(3, device="meta"),
                           }[k]()))

        @SET
        @given(st.dictionaries(st.one_of(names, st.integers(), st.none()), torch_vals, max_size=3),
               sizes, st.booleans(), st.sampled_from([(2, 3), (3, 2), (1, 3), (2, 3)]), st.booleans())
        def run(extra, mss, with_opt, load_shape, strict):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            d, before = based("torch")
            note("torch", extra, mss, with_opt, load_shape, strict)
            ok, _ = call(lambda: ckptstore.torch.save(d, model, opt if with_opt else None, extra=extra,
                                                      max_shard_size=mss, cleanup="inline"),
                         type_errors_ok=True)
            if not ok:
                assert_unchanged(d, before, BASE)
                return
            other = torch.nn.Linear(load_shape[1], load_shape[0])
            w_before = other.weight.detach().clone()
            ok, _ = call(lambda: ckptstore.torch.load(d, other, torch.optim.AdamW(other.parameters()) if with_opt else None,
                                                      strict=strict), type_errors_ok=False)
            if not ok:
                assert torch.equal(other.weight.detach(), w_before), "a failing load changed the model"
            else:
                assert torch.equal(other.weight.detach(), model.weight.detach())
            shutil.rmtree(d)

        run()

    props = {f.__name__: f for f in (save_hostile, save_right_types, read_hostile, optimizer_nan_inf,
                                      parts_hostile, lifetime, manager_hostile, open_hostile, torch_hostile, copy_hostile)}
    props[prop]()
    ckptstore.wait_for_cleanup()
    print(f"{prop}: {len(counter) - 1} examples run, {counter[0]} directories; calls: {dict(outcomes)}")


MAX_EXAMPLES = {  # about 2-4 s per property on a 2-core machine
    "save_hostile": 600,
    "save_right_types": 400,
    "read_hostile": 400,
    "optimizer_nan_inf": 250,
    "parts_hostile": 300,
    "lifetime": 200,
    "manager_hostile": 200,
    "open_hostile": 200,
    "torch_hostile": 150,
    "copy_hostile": 300,
}

# ------------------------------------------------------------------------------------
# The pytest side: one child per property, under a timeout
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prop", sorted(MAX_EXAMPLES))
def test_hostile(prop, tmp_path):

    last = tmp_path / "last-example.txt"
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        p = subprocess.run(
            [sys.executable, str(HERE), prop, str(tmp_path / "work"), str(last)],
            capture_output=True, text=True, errors="backslashreplace", timeout=60, env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{prop}: hung (no result in 60 s); last example: "
                    f"{last.read_text() if last.exists() else '?'}\n{e.stdout}\n{e.stderr}")
    if p.returncode != 0:
        pytest.fail(
            f"{prop}: child exited {p.returncode}"
            + (" (killed by a signal: a crash)" if p.returncode < 0 else "")
            + f"\nlast example: {last.read_text(errors='backslashreplace') if last.exists() else '?'}"
            + f"\n--- stdout ---\n{p.stdout[-8000:]}\n--- stderr ---\n{p.stderr[-8000:]}",
            pytrace=False,
        )


if __name__ == "__main__":
    os.makedirs(sys.argv[2], exist_ok=True)
    _child(sys.argv[1], sys.argv[2], sys.argv[3])


# ------------------------------------------------------------------------------------
# The findings the properties found (engine and torch-helper side), each fixed: every one
# raises the ckptstore exception named in test_fixed_findings.
# ------------------------------------------------------------------------------------


def _closed(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    ck = ckptstore.open(tmp)
    ck.close()
    return ck["w"]


def _surrogate_lookup(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    return ckptstore.open(tmp)["\udcff"]


def _region_negative(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    return ckptstore.open(tmp).read_region("w", [-1], [1])


def _region_huge(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    return ckptstore.open(tmp).read_region("w", [0], [2 ** 64])


def _torch_negative_shard_size(tmp):
    import ckptstore.torch

    torch = pytest.importorskip("torch")
    return ckptstore.torch.save(tmp, torch.nn.Linear(2, 2), max_shard_size=-1, cleanup="inline")


def _torch_surrogate_extra(tmp):
    import ckptstore.torch

    torch = pytest.importorskip("torch")
    return ckptstore.torch.save(tmp, extra={"\udcff": torch.ones(2)}, cleanup="inline")


def _chunk_repr(tmp):
    import ckptstore

    try:
        repr(ckptstore.Chunk([[1], [2, 3]], (2,), (0,)))
    except ValueError as e:  # not a CheckpointError
        raise AssertionError(f"Chunk.__repr__ raised {e!r}") from e
    raise ckptstore.CheckpointError("repr works")  # what test_fixed_findings expects


def _torch_meta_extra(tmp):
    import ckptstore.torch

    torch = pytest.importorskip("torch")
    return ckptstore.torch.save(tmp, extra={"m": torch.empty(3, device="meta")}, cleanup="inline")




def _contains_surrogate(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    ck = ckptstore.open(tmp)
    assert "\udcff" not in ck and 3 not in ck
    raise ckptstore.CheckpointError("in is False")


def _ranges_negative(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    return ckptstore.open(tmp).copy_ranges_into_unchecked([("w", -1, np.zeros(4, np.uint8))])


def _read_into_huge(tmp):
    import ckptstore

    ckptstore.save(tmp, {"w": np.ones(2, np.float32)})
    return ckptstore.open(tmp).read_into([("w", [2 ** 64], [1], np.zeros(4, np.uint8))])


@pytest.mark.parametrize(
    "case, error",
    [
        pytest.param(_closed, "InvalidArgumentError", id="closed-checkpoint"),
        pytest.param(_surrogate_lookup, "TensorNotFoundError", id="getitem-surrogate"),
        pytest.param(_contains_surrogate, "CheckpointError", id="contains-surrogate"),
        pytest.param(_region_negative, "InvalidArgumentError", id="read_region-negative"),
        pytest.param(_region_huge, "InvalidArgumentError", id="read_region-2**64"),
        pytest.param(_ranges_negative, "InvalidArgumentError", id="copy_ranges-negative"),
        pytest.param(_read_into_huge, "InvalidArgumentError", id="read_into-2**64"),
        pytest.param(_chunk_repr, "CheckpointError", id="Chunk-repr-ragged-list"),
        pytest.param(_torch_negative_shard_size, "InvalidArgumentError", id="torch.save-max_shard_size=-1"),
        pytest.param(_torch_surrogate_extra, "InvalidArgumentError", id="torch.save-surrogate-extra"),
        pytest.param(_torch_meta_extra, "InvalidTensorError", id="torch.save-meta-tensor"),
    ],
)
def test_fixed_findings(case, error, tmp_path):
    """The findings fixed in the bindings: each raises the `ckptstore` exception named."""
    import ckptstore

    with pytest.raises(getattr(ckptstore, error)):
        case(tmp_path / "ck")


def _nested(depth: int):
    v = 1
    for _ in range(depth):
        v = {"a": v}
    return v


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"metadata": {"a": _nested(126)}}, id="metadata-127-levels"),
        pytest.param({"metadata": {"a": _nested(126)}, "manager": True}, id="manager-metadata-127"),
        pytest.param(
            {"optimizer": {"param_groups": [{"params": ["w"], "lr": _nested(123)}],
                           "param_shapes": {"w": (1,)}}},
            id="optimizer-hyper-123-levels",
        ),
    ],
)
def test_deep_json_is_refused_before_anything_changes(kw, tmp_path):
    """Found by this file: user JSON nested past the reader's parser limit was committed,
    replacing a good checkpoint with one that does not open. Refused now, the old one
    kept whole."""
    import ckptstore

    kw = dict(kw)
    if kw.pop("manager", False):
        mgr = ckptstore.CheckpointManager(tmp_path / "run")
        with pytest.raises(ckptstore.CheckpointError, match="nests more than 64 levels"):
            mgr.save(1, {"w": np.ones(1)}, **kw)
        assert mgr.steps() == []
        return
    ckptstore.save(tmp_path, {"w": np.zeros(1)}, metadata={"run": "old"})
    with pytest.raises(ckptstore.CheckpointError, match="nests more than 64 levels"):
        ckptstore.save(tmp_path, {"w": np.ones(1)}, **kw)
    with ckptstore.open(tmp_path) as ck:
        ck.verify()
        assert ck.metadata == {"run": "old"} and ck["w"].tolist() == [0.0]
        return
    ckptstore.save(tmp_path, {"w": np.zeros(1)}, metadata={"run": "old"})
    try:
        ckptstore.save(tmp_path, {"w": np.ones(1)}, **kw)
    except ckptstore.CheckpointError:  # refusing is fine: the old checkpoint must stay
        with ckptstore.open(tmp_path) as ck:
            assert ck.metadata == {"run": "old"}
        return
    with ckptstore.open(tmp_path) as ck:  # committed: it must open
        ck.verify()
