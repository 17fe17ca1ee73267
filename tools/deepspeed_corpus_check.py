"""Run DeepSpeed's own config parser on every corpus file, as is and after the default HF "auto" fill.

Usage (where DeepSpeed is installed):

    DS_ACCELERATOR=cpu python tools/deepspeed_corpus_check.py tests/data/deepspeed_configs

Prints one JSON line per file: its "auto" keys, and for the file as is and after the fill either
DeepSpeedConfig's reading (stage, fp16/bf16, clipping, optimizer, scheduler, offload devices) or the
error it raised. The scheduler named in the file is also built on a dummy SGD optimizer. Engine-level
checks (optimizer construction) are not run; EXPECTED.json records those from the source.
"""

import copy
import glob
import json
import logging
import os
import sys

logging.disable(logging.WARNING)
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig

H = 4096
FILL = {  # default TrainingArguments, world_size 1, hidden 4096, 1000 training steps
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 8,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 5e-5,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": H * H,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * H * H),
    "zero_optimization.stage3_param_persistence_threshold": 10 * H,
    "scheduler.params.total_num_steps": 1000,
    "scheduler.params.warmup_num_steps": 0,
}


def autos(d, p=""):
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += autos(v, p + k + ".")
        elif v == "auto":
            out.append(p + k)
    return out


def setp(d, path, v):
    ks = path.split(".")
    for k in ks[:-1]:
        d = d[k]
    d[ks[-1]] = v


def parse(cfg):
    try:
        c = DeepSpeedConfig(copy.deepcopy(cfg))
        z = c.zero_config
        sched = None
        if c.scheduler_name:
            p = torch.nn.Parameter(torch.zeros(1))
            o = torch.optim.SGD([p], lr=1e-3)
            try:
                getattr(lr_schedules, c.scheduler_name)(o, **(c.scheduler_params or {}))
                sched = "ok"
            except Exception as e:
                sched = f"{type(e).__name__}: {e}"
        return dict(
            ok=True,
            stage=int(z.stage),
            fp16=c.float16_config.enabled,
            bf16=c.bfloat16_config.enabled,
            clip=c.gradient_clipping,
            opt=c.optimizer_name,
            sched=c.scheduler_name,
            sched_build=sched,
            off_opt=(z.offload_optimizer.device if z.offload_optimizer else "none"),
            off_param=(z.offload_param.device if z.offload_param else "none"),
            gather16=z.gather_16bit_weights_on_model_save,
            gad=c.grad_accum_dtype,
            bf16mw=c.bfloat16_config.bf16_master_weights_and_grads,
        )
    except BaseException as e:
        return dict(ok=False, err=f"{type(e).__name__}: {str(e)[:160]}")


for f in sorted(g for g in glob.glob(sys.argv[1] + "/*.json") if not g.endswith("EXPECTED.json")):
    cfg = json.load(open(f))
    a = autos(cfg)
    r1 = parse(cfg)
    filled = copy.deepcopy(cfg)
    unf = []
    for k in a:
        if k in FILL:
            setp(filled, k, FILL[k])
        else:
            unf.append(k)
    r2 = parse(filled) if a else None
    print(json.dumps(dict(file=os.path.basename(f), autos=a, unfillable=unf, as_is=r1, filled=r2)))
