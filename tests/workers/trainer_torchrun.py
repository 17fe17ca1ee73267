"""One rank of ``torchrun -m tests.workers.trainer_torchrun ROOT STAGE DTYPE`` (issue 27).

The HF Trainer recipe of :func:`tests.workers.integrations.trainer_case` (DtypeplanTrainer
with the HF docs' all-"auto" config, uninterrupted, resumed from its own checkpoint, against
the plain Trainer under DDP) in a process torchrun started: the process group is the one
``TrainingArguments`` makes from torchrun's variables, as in a user's run. Each rank pickles
``("ok", result)`` or ``("error", traceback)`` to ``ROOT/result.RANK.pkl``.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

import torch


def main() -> None:
    root, stage, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        from tests.workers.integrations import trainer_case

        outcome: tuple[str, object] = ("ok", trainer_case(root, stage, dtype, world))
    except Exception:  # noqa: BLE001 - every failure must reach the test
        outcome = ("error", traceback.format_exc())
    with open(os.path.join(root, f"result.{rank}.pkl"), "wb") as handle:
        pickle.dump(outcome, handle)


if __name__ == "__main__":
    main()
