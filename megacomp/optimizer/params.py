"""Parameter handling of the sharded optimizer: the default inner optimizer, the checks on the parameter
list, and plain-data comparison of checkpoint fields (megacomp.optimizer.distributed_optimizer)."""
from __future__ import annotations

import torch


def default_optimizer_class():
    """apex FusedAdam (AdamW mode) when apex and CUDA are present, else torch.optim.AdamW."""
    if torch.cuda.is_available():
        try:
            from apex.optimizers import FusedAdam  # type: ignore

            return lambda params, **kw: FusedAdam(params, adam_w_mode=True, **kw)
        except Exception:
            pass
    return torch.optim.AdamW


def param_groups_of(params) -> list[dict]:
    """Torch-style param groups from a list of parameters or of group dicts, frozen parameters dropped.
    Raises ValueError for an empty list, a parameter given twice, or several devices or dtypes."""
    params = list(params)
    if not params:
        raise ValueError("DistributedOptimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, seen = [], set()
    for g in groups:
        ps = [p for p in g["params"] if p.requires_grad]
        for p in ps:
            if id(p) in seen:
                raise ValueError("a parameter appears twice in DistributedOptimizer's parameters (tied weights must "
                                 "be passed once)")
            seen.add(id(p))
        out.append({**g, "params": ps})
    everything = [p for g in out for p in g["params"]]
    devices, dtypes = {p.device for p in everything}, {p.dtype for p in everything}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(f"parameters on devices {sorted(map(str, devices))} with dtypes {sorted(map(str, dtypes))} "
                         f"cannot share one flat buffer; build one DistributedOptimizer per device/dtype")
    return out


def plain_data(x):
    """Lists/tuples/dicts as plain nested lists/dicts, for comparing a loaded checkpoint with the live one."""
    if isinstance(x, (list, tuple)):
        return [plain_data(v) for v in x]
    if isinstance(x, dict):
        return {k: plain_data(v) for k, v in x.items()}
    return x
