"""DeepSpeed's checkpoint engine on ckptstore (tested with DeepSpeed 0.19.8, ZeRO stages 0-2, CPU;
ZeRO-3 is refused).

::

    import deepspeed
    from ckptstore.integrations import deepspeed as ckds

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    ckds.install(engine)                        # the one line
    engine.save_checkpoint("run/ckpt")          # tag global_step<N>, then `latest`
    engine.load_checkpoint("run/ckpt")          # the tag `latest` names

DeepSpeed has no configuration key that selects a checkpoint engine class, so
:func:`install` sets ``engine.checkpoint_engine`` after ``deepspeed.initialize`` (and wraps
the engine's ``save_checkpoint`` / ``load_checkpoint``, see below).

**Files.** DeepSpeed's save writes one object per file of a tag through
``CheckpointEngine.save(state_dict, path)``: ``<tag>/mp_rank_00_model_states.pt`` (module
weights, scheduler, step counters, client state, and under ZeRO-0 the optimizer) and under
ZeRO 1-2 one ``<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
(the flat FP32 partition and the base optimizer's state). Here each such path is **one
committed ckptstore checkpoint directory** of that name, holding the object as
:func:`ckptstore.integrations._tree.save_tree` stores it (every tensor a CRC-checked tensor
named by its path in the object, ``module/0.weight``,
``optimizer_state_dict/base_optimizer_state/state/0/exp_avg``; the rest as JSON in the
manifest). DeepSpeed's loader finds its files by name (``glob`` of
``<tag>/mp_rank_*_model_states.pt``), so keeping its names keeps its loader unchanged, and
``ckpt verify`` / ``ckpt inspect`` open each file's checkpoint at the path DeepSpeed names.
One checkpoint per file (rather than one per tag) also lets every rank write its own files
with no cross-rank commit.

**Commit.** Nothing of a tag is visible, and ``latest`` does not move, until its commit:

* ``create(info)`` opens the tag; the files are written (each a committed checkpoint) into
  a hidden staging directory ``<save_dir>/.<tag>.ckptstore-staging`` (``makedirs`` and
  ``save`` of paths under ``<save_dir>/<tag>`` are redirected there);
* ``commit(info)`` waits for every rank (a barrier), then the global rank 0 makes the staged
  tag visible in one ``rename(2)`` to ``<save_dir>/<tag>`` (an existing tag of the same name
  is swapped atomically with ``renameat2(RENAME_EXCHANGE)`` on Linux, then removed), fsyncs
  the directory (:func:`ckptstore.atomic.publish_dir`), and only then writes ``latest`` (to
  a temporary file, fsynced, renamed over ``latest``: :func:`ckptstore.atomic.write_file`). DeepSpeed itself
  rewrites ``latest`` after ``commit`` returns with a plain
  ``open(..., "w")``, which a kill can leave empty; :func:`install` makes the engine skip
  that write (it passes ``save_latest=False`` and hands the real flag to this engine).

A process killed anywhere before the rename leaves the previous tags and ``latest`` as they
were (its staging directory is removed by the next save into ``save_dir``); killed after it,
the new tag is complete and ``latest`` names the previous tag or the new one.

**Load.** ``load(path, map_location)`` returns the object ``save`` was given: tensors as
fresh CRC-checked tensors, equal bit for bit, dicts, lists, tuples, ``OrderedDict``,
``torch.Size`` and the DeepSpeed values below with their types. DeepSpeed loads a tag's files
one after the other and applies each as it comes (the module weights first, then the ZeRO
partition), so a damaged optimizer file would fail after the model was already changed. The
``load_checkpoint`` that :func:`install` wraps therefore first loads every file of the tag
that this rank reads (a file of another data-parallel rank's ZeRO partition is skipped),
each CRC-checked, before DeepSpeed's loader runs; DeepSpeed's loader then gets those objects
from memory. A damaged tensor raises :class:`ckptstore.errors.ChecksumError` naming the file
and the tensor, and the live model, optimizer, scheduler and step counters are unchanged.
The cost: the model file's objects stay in memory while the ZeRO partition loads (DeepSpeed
frees them first).

**A change of optimizer class** (a tag saved by AdamW, loaded into an engine whose optimizer
is ``SGD``): DeepSpeed's files do not name the optimizer class, so the ``save_checkpoint``
that :func:`install` wraps records it (``type(optimizer).__name__`` of the base optimizer,
``engine.basic_optimizer``, the torch optimizer under ZeRO's or FP16's wrapper, as
:func:`ckptstore.torch.save` records it) in every file of the tag (the top-level key
``$deepspeed.optimizer_class`` of the stored object, JSON in the file's manifest; tensor names
are unchanged and ``load`` returns the object without it). The ``load_checkpoint`` that
:func:`install` wraps, when it loads optimizer states (not with ``load_optimizer_states=False``
or ``load_module_only=True``), checks it when DeepSpeed takes the first file (the model
states, before DeepSpeed applies anything) by rule F1 of the one rule,
:func:`ckptstore.check_optimizer_fit`: another class raises
:class:`ckptstore.IncompatibleStateError` naming both classes (and the file), and the live
model, optimizer, scheduler and step counters are unchanged. ``install(engine,
allow_optimizer_change=True)`` (or ``engine.checkpoint_engine.allow_optimizer_change =
True``) lets a deliberate change through: DeepSpeed loads the checkpoint's optimizer state as
stored, and each parameter group gets the checkpoint's hyperparameters plus the live group's
own for the settings the checkpoint's lacks (an ``SGD`` loaded from AdamW keeps its
``momentum``), as :func:`ckptstore.torch.load` does. A tag saved without the class (before
this, or by an engine not installed with :func:`install`) is loaded unchecked.

**Non-tensor values.** JSON values are stored as JSON; tuples, ``OrderedDict``,
``torch.Size``, ``torch.dtype``, non-string keys, non-finite floats and bytes in the tagged
forms of the value codec (format-spec/values.md). DeepSpeed's own values in its state dicts are stored
structurally, without
pickle, and rebuilt as the same types: ``ZeroStageEnum``, the ZeRO optimizer's
``LossScaler`` / ``DynamicLossScaler`` (their attributes) and ``fragment_address``, and an
``argparse.Namespace`` (its attributes) in the client state; only these classes are rebuilt,
looked up in a fixed table, never imported by a name read from the checkpoint. Any other
object (a custom class in ``client_state``) raises
:class:`ckptstore.integrations._tree.PickleNotAllowedError` naming its path (nothing of the
tag becomes visible), unless the engine is made with ``allow_pickle=True``: then it is
pickled, and loading it needs ``allow_pickle=True`` too. Unpickling runs code chosen by
whoever wrote the checkpoint: opt in only for checkpoints you trust as much as the code you
run.

**A run begun with DeepSpeed's default engine** (switched to ckptstore later): a tag of
``torch.save`` files loads as DeepSpeed loads it, except that each file is read with
``torch.load(weights_only=True)`` allowing only the DeepSpeed classes of the table above and
``argparse.Namespace`` (DeepSpeed's own engine uses ``weights_only=False``); a warning in the
log names the tag. Such files have no CRCs. A file that needs more than that raises
:class:`PickleNotAllowedError` unless the engine is made with ``allow_pickle=True``, which
reads it with ``weights_only=False`` (the same trust as above). The next tags saved are
ckptstore checkpoints.

**Non-blocking saves** (``install(engine, non_blocking=True)``): ``save_checkpoint``
returns once every tensor is copied into snapshot buffers (one set per file name, reused by
the next tag); the files are written and the tag published (the same rename, then
``latest``) on background threads while training goes on. The next save, a load and
``engine.checkpoint_engine.wait()`` wait for it and raise its error; the interpreter's exit
waits for it too (the threads are not daemons). One tag is in flight at a time.

Test seam (``ckptstore._faults``): ``CKPTSTORE_FAULT=deepspeed.<point>`` makes the process
SIGKILL itself at ``save`` (after a file of a tag has been committed into the staging
directory, or handed to its background writer), ``publish`` (every file written, before the
rename) or ``latest`` (after the rename, before ``latest`` is written).

ZeRO-3 is refused by :func:`install` (``InvalidArgumentError``): DeepSpeed reads a ZeRO-3
tag's files itself where no checkpoint engine is asked (a load without optimizer states
rebuilds the module with ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, which
reads every rank's files with ``torch.load``), so its checkpoints stay DeepSpeed's own. Not covered:
NVMe offload is untested (it copies its swap files into the tag directory with
``shutil.copytree``, bypassing the engine). Several processes: a
shared file system is assumed (every rank writes its files into the one staging directory,
barriers around rank 0's publish); tested with two (ZeRO-1). Node-local storage is not
supported.
``save_16bit_model`` goes through the engine too: its ``pytorch_model.bin`` becomes a
ckptstore checkpoint directory of that name (committed on its own), not a file
``from_pretrained`` reads. The ``zero_to_fp32.py`` script DeepSpeed copies into
``save_dir`` reads ``torch.save`` files, not these.
"""

from __future__ import annotations

from ...errors import PickleNotAllowedError
from ._engine import KILL_ENV, KILL_POINTS, CheckpointEngine  # noqa: F401 - deprecated names
from ._install import install

__all__ = ["CheckpointEngine", "install", "PickleNotAllowedError"]
