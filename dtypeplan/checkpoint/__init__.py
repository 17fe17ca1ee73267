"""Distributed checkpoints of a dtypeplan optimizer that reshard across world sizes and stages.

    dtypeplan.checkpoint.save(optimizer, "ckpt/run1")   # on every rank of the optimizer's group
    dtypeplan.checkpoint.load(optimizer, "ckpt/run1")   # any world size, any ZeRO stage

What is stored: everything the optimizer owns -- the fp32 master weights, every full-size
optimizer state (``exp_avg``, ``momentum_buffer``, ...), the step count, the loss scaler, the
skipped-step count and the param groups' hyperparameters. The inner optimizer's scalar states
(``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``...) are kept per param group
(``scalars.group_states`` in the manifest) and, as ``torch.optim`` keeps them per parameter,
for each parameter whose own differ from its group's (``scalars.param_states``: a parameter
whose first gradient came after the group's first step, or that skipped a step, such as an MoE
expert no token was routed to), or that has no state yet. So a resumed run counts each
parameter's steps as the uninterrupted one does, at any world size and ZeRO stage. Manifest
version 2 added ``param_states``; a version-1 checkpoint (one count per group) still loads.
The model's weights are the master weights cast to the parameter dtype, so ``load`` writes
them into the parameters as well.
Frozen parameters (``requires_grad=False``) are not the optimizer's and are not stored.

On disk (``path`` is a directory)::

    path/LATEST                  one line: the name of the current snapshot
    path/snapshot-<hex>/         a torch.distributed.checkpoint (DCP) directory ...
    path/snapshot-<hex>/manifest.json   ... plus what DCP does not describe (see _manifest)

Every tensor is stored under ``param.{i}.{name}`` as a 1-D fp32 tensor (``i`` numbers the
trainable parameters over all param groups in order, as ``MixedPrecisionOptimizer.full_state``
does); shapes live in the manifest: the parameters' in ``shapes``, and each stored tensor's own
in ``tensors`` (manifest version 3), per parameter ``{name: shape}``. The flat and FSDP2
optimizers keep every state laid out like its parameter (the parameter's ``numel``), the
whole-tensor one (``optimizers/whole``: Muon, Adafactor, DeepSpeed's ``"Muon"``) what its class
keeps for each parameter: Adafactor's ``row_var`` ``[rows, 1]`` and ``col_var`` ``[1, cols]``
of a matrix and a vector's ``variance``; Muon's ``momentum_buffer`` on the matrices and AdamW's
``exp_avg`` and ``exp_avg_sq`` on the other parameters of DeepSpeed's Muon. Its parameters'
scalar states (``step``; the stochastic rounding count of bf16 masters) are each parameter's
own (``scalars.param_states``), as the parameters of one group need not keep the same ones;
a Kahan master's compensation is loaded as saved, since the forward runs on the bf16 weight.
A version-1 or -2 checkpoint (every parameter holds every state of ``states``, laid out like
it) still loads. A checkpoint whose states the loading optimizer's class would not keep for a
parameter (another split of DeepSpeed's Muon: a matrix saved with Muon's momentum and loaded
where AdamW steps it, whose moments would start at zero; or, in a flat optimizer, a state not
laid out like its parameter) raises :class:`CheckpointMismatchError` naming the parameter and
both sets of states; another class is refused as always.

Whatever the optimizer's state dtypes, a state is stored as the fp32 values it stands for:
bf16 moments exactly, int8 / fp8 moments (torchao's blockwise codes) dequantized, read through
``optimizer.fp32_states()`` (which gives the codes back untouched after a save). So a
checkpoint loads into any state dtype: into fp32 exactly, into bf16 rounded to nearest (2**-9
relative). int8 / fp8 moments are saved besides as their codes and block scales, one pair of
tensors per parameter piece (``codes.{i}.{name}.{begin}-{end}.{tag}.codes`` / ``.scales``,
``tag`` the state format's own, ``dtypeplan/_formats.py``; listed in the manifest's ``codes``):
a load whose piece of that parameter is the same and whose moment is stored in the format of
that tag restores them bit for bit (two formats may share a codes dtype; the tag tells them
apart). Quantizing values anew is not idempotent
(torchao's signed map ends at -0.993: a block's absmax moves, and every code with it), so it is
for another layout only (resharding), in the loading layout's blocks of 256: each value within
the format's error of its block's largest value (12.3% relative for signed int8's dynamic-tree
map, 6.6% unsigned, 6.25% for fp8 e4m3, for values above 1e-2 of the absmax; measured on the
tests' MLP after 3 steps: at most 0.7% (int8) / 3.6% (fp8) of the block's absmax). Kahan masters
save their compensation too (``param.{i}.kahan_compensation``, fp32), so a load into Kahan
masters restores each (weights, compensation) pair bit for bit; other masters take the values.

Sharded I/O. For the built-in optimizers (the flat-buffer ones of ZeRO 0-2 and ZeRO-3's FSDP2
one) each rank writes only the pieces of each parameter that its own shard holds, as DCP chunks
with their offsets, and on load reads only the pieces that its new shard needs; DCP's
resharding matches old chunks to new ones. No rank ever materializes the full state. (At ZeRO
stage 0 every rank holds everything; DCP then writes each piece once. In a hybrid layout,
``shard_group_size`` S < W at stages 1-2, the ranks of the first shard group write and the
other groups, which hold the same pieces, write nothing; a load reads each rank's pieces
whatever the layout, so flat N ranks and S x N/S load each other's checkpoints, whatever the
wire dtypes, which are not state.) Any other
``MixedPrecisionOptimizer`` goes through its layout-free ``full_state()`` /
``load_full_state()``: full tensors, replicated on every rank and written once. Both ways write
the same format, so either reads what the other wrote. (The sharded way uses the optimizer's
public ``shard_pieces()``, ``state_names()``, ``reset_update_state()``, ``refresh_params()``
and, for the per-parameter scalar states, ``param_scalar_state()`` / ``load_param_scalars()``
in ``_adapters.FlatAdapter``; a ZeRO-3 rank's pieces are its local FSDP2 shards, so a ZeRO-3
save or load gathers nothing.)

Atomic replacement. A save writes ``snapshot-<hex>.tmp`` inside ``path``; when every rank has
written (DCP's final collective) rank 0 adds the manifest, renames the directory to
``snapshot-<hex>``, and atomically replaces ``LATEST`` (write, fsync, ``os.replace``). Only then
are older snapshots and leftovers of saves that died deleted. A save that fails (an error on
any rank: a full disk, a read-only filesystem, ...) removes its temporary directory at once,
and its error names the OS cause ("no space left on device"). A save that dies at any point leaves
``LATEST`` naming the previous complete snapshot, so ``load(path)`` still works. Concurrent
saves into one ``path`` are not supported.

Checks on load. A missing ``LATEST``, snapshot or data file, a file whose size differs from the
size recorded at save (truncation), a manifest that is not valid, or any failure inside DCP
raises :class:`CheckpointError` naming the path. The manifest records the sha256 of every data
file; ``load`` checks them (each rank a share of the files, about 0.5 s per GB per rank on a CPU
with SHA instructions) and refuses bytes overwritten in place, sizes kept; ``load(...,
verify=False)`` checks sizes only. The whole manifest (types, ranges, shapes, the loss scaler's
state, hyperparameters that fit the optimizer's) and every file are checked before anything of
the optimizer is changed. A checkpoint
whose parameter count or shapes or ``torch.optim`` class (``AdamW``, ``RMSprop``, ...) differ
from the optimizer's raises :class:`CheckpointMismatchError` listing the differences, and so
does one with another number of param groups once it holds per-group scalar states (the
step count of every class but SGD, after the first step): they cannot be assigned to other
groups, and ``torch.optim.Optimizer.load_state_dict`` refuses another group count too. A
checkpoint without them (SGD, or saved before the first step) loads into another number of
groups with a warning and keeps the optimizer's hyperparameters. A different world size, ZeRO
stage, implementation or parameter dtype is allowed: the masters are fp32 whatever the
parameter dtype, so a run saved in fp32 resumes in bf16 and back. The loss scaler is restored
only when both the checkpoint and the optimizer use fp16. With as many param groups as the
optimizer, the hyperparameters (``lr``, ``betas``, ...) are restored from the checkpoint, as
``torch.optim.Optimizer.load_state_dict`` does. A load that fails leaves the optimizer as it
was: pieces are read into staging tensors (one shard's worth) and copied in only at the end.

What a checkpoint is trusted for. A load runs no code from the checkpoint: a directory from
elsewhere (a shared cluster folder, a downloaded run, a Trainer's ``resume_from_checkpoint``
pointed at someone else's folder) can at worst be refused, or load wrong numbers into the
optimizer; it cannot make the load call anything. Every file a load reads is parsed as data:

* ``LATEST``: UTF-8 text of at most 4 KiB, a regular file opened without blocking, which must
  be a ``snapshot-<16 hex>`` name;
* ``manifest.json``: JSON (``json.loads``, at most 1 GiB), then checked field by field
  (``_manifest.check_manifest``); every data file it lists must be a regular file in the
  snapshot of the recorded size;
* ``.metadata`` (DCP's, a pickle): read by ``_metadata``'s restricted unpickler, on every rank
  before any data file is read (after LATEST and the manifest). It admits only the globals
  DCP's metadata is made of (``_metadata.ADMITTED``: its dataclasses and ``_StorageInfo``,
  ``torch.Size``, torch's dtypes and layouts, ``pathlib`` paths read as pure paths), calls
  and fills in only instances of those, and refuses any other global, persistent id or
  extension code with a :class:`CheckpointError` naming it (``... names the global
  posix.system ...``). The result must have the shape a save writes: tensor entries whose
  storage items lie inside data files the manifest lists, with no stream transforms;
* the data files (``__<rank>_0.distcp``): with ``verify``, hashed (sha256 of the bytes, nothing
  parsed); then DCP reads each tensor from its slice with ``torch.load(weights_only=True)``
  (torch's own restricted unpickler).

The HF Trainer integration also reads its ``scheduler.pt`` with ``torch.load(weights_only=True)``;
the Trainer, Lightning and Accelerate integrations resume the optimizer through ``load`` alone
(the frameworks' own files -- model weights, RNG states, Lightning's ``.ckpt`` -- are read by
the frameworks, under their rules). ``export_model_state`` reads no file. Resharding, hybrid
and ZeRO-3 loads are ``load`` too.

What ``verify=True`` proves: that each file holds the bytes the manifest recorded (sha256),
so a file damaged or overwritten in place after the save is refused, and, for ``.metadata``,
that the very bytes parsed are the recorded ones. What it does not prove: who wrote the
checkpoint. The digests live in ``manifest.json`` beside the files, unsigned, so whoever can
write the files can rewrite the manifest to agree; ``verify`` detects accidents (a torn copy, a
bad disk), not an attacker. Against a hostile checkpoint the guarantees are the parsing above
(no code runs, nothing outside the snapshot is opened, the optimizer is unchanged on refusal),
not the numbers: a checkpoint you did not write may hold any values the format allows (large
learning rates, NaN moments), so load one only from a source you would train from. The format
on disk is DCP's unchanged: ``torch.distributed.checkpoint.load`` with torch's own
``FileSystemReader`` still reads a snapshot, trusting its ``.metadata`` as plain pickle does.

Both calls are collective over the optimizer's process group (the default group when it has
none, a single process when ``torch.distributed`` is not initialized). Every rank must see the
same ``path`` (a shared filesystem). Errors are agreed on: when one rank fails, every rank
raises, so no rank is left waiting in a collective; a peer that dies or stalls past the group's
timeout makes the agreement collective fail as a :class:`CheckpointError` that says so.

The trained weights by parameter name, for ``save_pretrained`` and the like::

    state = dtypeplan.checkpoint.export_model_state(optimizer, model)  # on every rank

gives the fp32 master weights keyed by ``model.named_parameters()`` names (tied names all
present, sharing one tensor) at every stage. It is collective at stages 1-3 (it gathers one
parameter at a time), so every rank must call it; ``rank0_only=True`` keeps the result on
rank 0 only, and each tensor goes to CPU as it is gathered unless ``cpu=False``.

Modules: ``_io`` (the steps of ``save`` and ``load``), ``_collective`` (the group, and errors
agreed on by every rank), ``_adapters`` (an optimizer's state as pieces, and which states it
stores of each parameter), ``_planners`` (DCP
planners for those pieces), ``_manifest`` and ``_directory`` (the files on disk),
``_metadata`` (DCP's metadata read without running code, and the storage reader using it),
``_export`` (the weights by name), ``_errors``.
"""

from dtypeplan.checkpoint._directory import LATEST as LATEST
from dtypeplan.checkpoint._directory import MANIFEST as MANIFEST
from dtypeplan.checkpoint._errors import CheckpointError, CheckpointMismatchError
from dtypeplan.checkpoint._export import export_model_state
from dtypeplan.checkpoint._io import load, save
from dtypeplan.checkpoint._manifest import FORMAT as FORMAT
from dtypeplan.checkpoint._manifest import FORMAT_VERSION as FORMAT_VERSION

__all__ = ["CheckpointError", "CheckpointMismatchError", "export_model_state", "load", "save"]
