"""Golden numbers for AdamW + global-norm clipping from torch (run with a torch venv, not in make test).

    /path/to/torch-venv/bin/python tools/make_optim_golden.py > tests/finetune/golden/adamw.json
"""
import json

import numpy as np
import torch

rng = np.random.default_rng(0)
shapes = {"w": (4, 3), "b": (3,)}
init = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
grads = [{k: (rng.normal(size=s) * (5.0 if i == 1 else 0.5)).astype(np.float32) for k, s in shapes.items()}
         for i in range(4)]
lrs = [1e-2, 2e-2, 5e-3, 1e-2]
params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
opt = torch.optim.AdamW([{"params": [params["w"]], "weight_decay": 0.01},
                         {"params": [params["b"]], "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.999), eps=1e-6)
norms = []
for g, lr in zip(grads, lrs):
    for k, p in params.items():
        p.grad = torch.tensor(g[k])
    norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)))
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
print(json.dumps({"init": {k: v.tolist() for k, v in init.items()},
                  "grads": [{k: v.tolist() for k, v in g.items()} for g in grads], "lrs": lrs,
                  "norms": norms, "final": {k: p.detach().numpy().tolist() for k, p in params.items()}}))
