"""An HF Trainer script run as it is, with each rank writing what it holds when training ends.

``dtypeplan run --nproc_per_node 2 hf_rank_facts.py OUT SCRIPT [ARGS...]`` runs ``SCRIPT ARGS``
as ``dtypeplan run SCRIPT ARGS`` would (``runpy``, ``__name__`` is ``"__main__"``): the
script, unedited, with its own Trainer on dtypeplan. The one addition is a ``TrainerCallback``
among transformers' default callbacks (every Trainer the script makes gets it): at
``on_train_end`` each rank writes ``OUT/ran.RANK.json``, what it holds (tests/launched/
whole.py), since the Trainer logs and saves one rank's view only.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import torch
import transformers

from tests.launched.whole import what_ran


class RankFacts(transformers.TrainerCallback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        facts = what_ran(kwargs["optimizer"], kwargs["model"])
        rank = torch.distributed.get_rank()
        with open(os.path.join(self.out, f"ran.{rank}.json"), "w", encoding="utf-8") as handle:
            json.dump(facts, handle)


def main() -> None:
    out, script, *rest = sys.argv[1:]
    transformers.trainer.DEFAULT_CALLBACKS.append(RankFacts(out))
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
