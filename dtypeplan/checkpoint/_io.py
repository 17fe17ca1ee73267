"""``save`` and ``load``: the steps of each, every one agreed on by all ranks of the group."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch.distributed.checkpoint as dcp

from dtypeplan.checkpoint._adapters import (
    CODES_PREFIX,
    GROUP_STATES,
    PARAM_STATES,
    adapter_for,
    merge_group_states,
)
from dtypeplan.checkpoint._collective import Group
from dtypeplan.checkpoint._directory import (
    commit_directory,
    digest_share,
    discard_snapshot,
    open_snapshot,
    prepare_directory,
    verify_share,
)
from dtypeplan.checkpoint._errors import CheckpointError, CheckpointMismatchError
from dtypeplan.checkpoint._manifest import (
    build_manifest,
    differences,
    hyperparameter_problems,
    restore_hyperparameters,
    stored_tensors,
)
from dtypeplan.checkpoint._metadata import MetadataReader, read_metadata
from dtypeplan.checkpoint._planners import PieceLoadPlanner, PieceSavePlanner
from dtypeplan.optimizers.contract import MixedPrecisionOptimizer

__all__ = ["load", "save"]


def save(opt: MixedPrecisionOptimizer, path: str | os.PathLike[str]) -> None:
    """Write a checkpoint of ``opt`` to the directory ``path``; collective over its group.

    Replaces an earlier checkpoint at ``path`` atomically: if the save fails or dies, the
    previous one stays loadable. Raises :class:`CheckpointError` on every rank if any rank fails.
    """
    path = os.fspath(path)
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(f"save() takes a dtypeplan optimizer, not {type(opt).__name__}")
    group = Group(opt.process_group, path)
    name = group.agree(
        lambda: prepare_directory(path) if group.rank == 0 else None, "preparing", path
    )
    name = group.broadcast(name)
    assert name is not None  # rank 0 prepared it, or agree() raised on every rank
    try:
        _save_into(opt, group, path, name)
    except Exception:
        # A failed save removes what it wrote (on a full disk every retry would otherwise leave
        # another snapshot behind). A process that dies leaves it to the next save's clean-up.
        if group.rank == 0:
            discard_snapshot(path, name)
        raise


def _save_into(opt: MixedPrecisionOptimizer, group: Group, path: str, name: str) -> None:
    tmp = os.path.join(path, name + ".tmp")
    adapter = adapter_for(opt)

    local_names = group.agree(adapter.state_names, "listing the optimizer states", path)
    # A state one rank has not created yet is still saved (as zeros) so that chunks cover it.
    names: list[str] = []
    for rank_names in group.all_gather(local_names):
        names += [n for n in rank_names if n not in names]
    flats, scalars = group.agree(
        lambda: (adapter.save_pieces(names), adapter.scalars()), "collecting the state", path
    )
    # Quantized moments' codes, per piece: rank 0's manifest lists every rank's.
    local_codes = sorted(key for key in flats if key.startswith(CODES_PREFIX))
    codes = sorted({key for keys in group.all_gather(local_codes) for key in keys})
    # Rank 0 writes the manifest: its per-group scalar states must be every rank's.
    for entry in (GROUP_STATES, PARAM_STATES):
        per_rank: list[dict[str, dict[str, Any]]] = group.all_gather(scalars[entry])
        scalars[entry] = group.agree(
            functools.partial(merge_group_states, per_rank),
            "comparing the optimizer's scalar states",
            path,
        )
    group.dcp(
        lambda: dcp.save(
            {},
            storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
            planner=PieceSavePlanner(flats),
            process_group=opt.process_group,
            no_dist=not group.distributed,
        ),
        path,
        "writing",
    )

    share = group.agree(
        lambda: digest_share(path, name, group.rank, group.size), "hashing the files", path
    )
    digests = {entry: value for part in group.all_gather(share) for entry, value in part.items()}

    def commit() -> None:
        if group.rank == 0:
            manifest = build_manifest(
                opt, adapter, names, scalars, group.size, codes, adapter.tensors(names)
            )
            commit_directory(path, name, manifest, digests)

    group.agree(commit, "committing", path)


def load(
    opt: MixedPrecisionOptimizer, path: str | os.PathLike[str], *, verify: bool = True
) -> None:
    """Load the checkpoint at ``path`` into ``opt`` and its model; collective over its group.

    The checkpoint may come from another world size, ZeRO stage or parameter dtype. Raises
    :class:`CheckpointMismatchError` if its parameters, optimizer class or (once it holds
    step counts) number of param groups differ from ``opt``'s,
    :class:`CheckpointError` if it is missing, incomplete or corrupt; ``opt`` is then unchanged:
    the manifest (types, ranges, shapes, hyperparameters) and every file are checked before
    anything is changed. ``verify`` checks each data file's sha256 against the manifest (the
    ranks share the files; about 0.5 s per GB per rank with SHA-NI); ``False`` checks sizes only.
    """
    path = os.fspath(path)
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(f"load() takes a dtypeplan optimizer, not {type(opt).__name__}")
    group = Group(opt.process_group, path)
    opened = group.agree(lambda: open_snapshot(path) if group.rank == 0 else None, "opening", path)
    shared = group.broadcast(opened)
    assert shared is not None  # rank 0 opened it, or agree() raised on every rank
    snapshot, manifest = shared
    # Before any data file is read: DCP's metadata, through an unpickler that runs no code.
    metadata = group.agree(
        lambda: read_metadata(snapshot, manifest, verify=verify), "reading the DCP metadata", path
    )
    if verify:
        group.agree(
            lambda: verify_share(snapshot, manifest, group.rank, group.size), "verifying", path
        )
    adapter = adapter_for(opt)
    shapes = group.agree(adapter.shapes, "reading the parameter shapes", path)

    def check() -> None:
        found = differences(manifest, opt, shapes)
        if not found:
            found = adapter.problems(stored_tensors(manifest), list(manifest["states"]))
        if found:
            raise CheckpointMismatchError(
                f"{path}: the checkpoint does not fit this optimizer:\n  - " + "\n  - ".join(found),
                path,
            )

    group.agree(check, "checking", path)

    def check_hyperparameters() -> None:
        found = hyperparameter_problems(manifest, opt)
        if found:
            raise CheckpointError(
                f"{path}: the manifest's hyperparameters are not valid:\n  - "
                + "\n  - ".join(found),
                path,
            )

    group.agree(check_hyperparameters, "checking the hyperparameters", path)
    names = list(manifest["states"])
    codes = manifest.get("codes", [])
    tensors = stored_tensors(manifest)
    flats = group.agree(
        lambda: adapter.load_targets(names, shapes, codes, tensors), "allocating", path
    )
    group.dcp(
        lambda: dcp.load(
            {},
            storage_reader=MetadataReader(snapshot, metadata),
            planner=PieceLoadPlanner(flats, path),
            process_group=opt.process_group,
            no_dist=not group.distributed,
        ),
        path,
        "reading",
    )
    adapter.commit(flats, names, manifest["scalars"])
    restore_hyperparameters(opt, manifest["param_groups"])
