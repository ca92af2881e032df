"""PyTorch on the parameter servers: a module's parameters live in the
worker's flat vector, and the optimizer on the servers.

    import psclient, psclient.torch
    w = psclient.connect("127.0.0.1:5000", insecure=True)
    ps = psclient.torch.PSModule(model, w)      # the parameters become views of w.params
    for x, y in batches:
        ps.pull()                                # the servers' parameters, in place
        loss = F.cross_entropy(model(x), y)
        ps.zero_grad(); loss.backward()          # the gradients land in w.grads
        ps.push(batch_size=len(x))               # the servers' optimizer applies them

No copies: after :class:`PSModule` every parameter's ``.data`` is a view of
``w.params`` and its ``.grad`` a view of ``w.grads``, so a pull writes the
module's weights straight from the received bytes and a push sends the
gradients that backward() accumulated, as they are.

Which parameter is which range of the vector (see :meth:`PSModule.describe`):

* a job whose model has layers (e.g. deploy/jobs/fashion_mnist_cnn.json):
  the job's layout, so that this worker and C ps-workers train one job
  together. The module's parameters, in ``named_parameters()`` order, go to
  the job's tensors in layout order (conv2d weight (OC, IC, KH, KW) then its
  bias, dense weight (OUT, IN) then its bias: PyTorch's own shapes and
  order), each shape checked; or as ``mapping`` says ({parameter name: job
  tensor name}). A flatten is NCHW's (C, H, W) order in both. Jobs with
  batchnorm layers are refused (their moving statistics travel in the
  gradient, which this adapter does not fill).
* a flat job ({"params": P}, see :func:`flat_job`): its named tensors by
  name, else the module's parameters one after another in
  ``named_parameters()`` order. Buffers (batch norm's running statistics)
  are not in the vector: each worker keeps its own.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .worker import PushResult, Tensor, Worker

__all__ = ["PSModule", "flat_job", "tensors_of"]


def _init_of(p: torch.Tensor) -> Dict[str, Any]:
    """A job "init" that draws values like p's: a constant, or the uniform
    or normal distribution of p's spread (PyTorch's default initializers are
    uniform; embeddings are normal)."""
    x = p.detach().double().flatten()
    lo, hi = float(x.min()), float(x.max())
    if lo == hi:
        return "zeros" if lo == 0.0 else {"constant": lo}
    std = float(x.std()) if x.numel() > 1 else abs(lo)
    if x.numel() >= 16:
        c = x - x.mean()
        kurt = float((c ** 4).mean() / (c ** 2).mean() ** 2) - 3.0
        if kurt > -0.6:  # a uniform distribution's is -1.2, a normal's 0
            return {"normal": std}
    return {"uniform": math.sqrt(3.0) * std}


def tensors_of(module: torch.nn.Module) -> List[Dict[str, Any]]:
    """A flat job's "tensors" for module: its parameters in
    ``named_parameters()`` order, each with its shape and an init that draws
    values like the module's own."""
    return [{"name": n, "shape": list(p.shape) or [1], "init": _init_of(p)}
            for n, p in module.named_parameters()]


def flat_job(module: torch.nn.Module, job_id: str, *,
             optimizer: Optional[Mapping[str, Any]] = None, **job: Any) -> Dict[str, Any]:
    """A job file (as a dict, for json.dump) whose model is module's
    parameters as a flat vector, named and initialized tensor by tensor:
    ``{"job_id", "model": {"params": P, "tensors": [...]}, "optimizer", ...}``
    with any other job keys given (batch_size, epochs, mode, lease_chunk...)."""
    tensors = tensors_of(module)
    params = sum(math.prod(t["shape"]) for t in tensors)
    out: Dict[str, Any] = {"job_id": job_id, "model": {"params": params, "tensors": tensors},
                           "optimizer": dict(optimizer or {"name": "adam", "lr": 0.001})}
    out.update(job)
    return out


class PSModule:
    """A torch.nn.Module whose parameters are ranges of a worker's flat vector
    (see the module's documentation for which). Only float32 CPU modules.

    Args:
        module: the model; its parameters' storage is replaced by views.
        worker: the connected :class:`psclient.Worker`.
        mapping: {parameter name: job tensor name}, instead of the order.
    """

    def __init__(self, module: torch.nn.Module, worker: Worker, *,
                 mapping: Optional[Mapping[str, str]] = None) -> None:
        self.module = module
        self.worker = worker
        self.flat = torch.from_numpy(worker.params)
        self.flat_grad = torch.from_numpy(worker.grads)
        named = list(module.named_parameters())
        for n, p in named:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ValueError(f"parameter {n}: {p.dtype} on {p.device}; the servers hold "
                                 "float32, pulled to the CPU: use module.float().cpu()")
        self.placement: List[Tuple[str, Tensor]] = self._place(named, mapping)
        self._params = [p for _, p in named]
        self._views: List[Tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for (name, t), p in zip(self.placement, self._params):
                data = self.flat[t.offset:t.offset + t.count].view(p.shape)
                grad = self.flat_grad[t.offset:t.offset + t.count].view(p.shape)
                data.copy_(p.data)  # the module's values until the first pull
                p.data = data
                p.grad = grad
                self._views.append((data, grad))

    # ---- the layout ----

    def _place(self, named: Sequence[Tuple[str, torch.nn.Parameter]],
               mapping: Optional[Mapping[str, str]]) -> List[Tuple[str, Tensor]]:
        w = self.worker
        model = w.job.get("model", {})
        tensors = list(w.tensors.values())
        if "layers" in model:
            bn = [t.name for t in tensors if t.name.endswith(".moving_mean")]
            if bn:
                raise ValueError(f"the job's model has batchnorm layers ({', '.join(bn)}): their "
                                 "moving statistics travel in the gradient, which psclient.torch "
                                 "does not fill; use a flat job (psclient.torch.flat_job)")
        elif not tensors:  # a flat job without names: one parameter after the other
            tensors, off = [], 0
            for n, p in named:
                tensors.append(Tensor(n, off, p.numel(), tuple(p.shape)))
                off += p.numel()
            if off != w.param_count:
                raise ValueError(f"the module has {off} parameters, the job {w.param_count}")
            return list(zip([n for n, _ in named], tensors))
        elif mapping is None and all(n in w.tensors for n, _ in named):
            mapping = {n: n for n, _ in named}
        if mapping is not None:
            return self._place_by_name(named, mapping)
        return self._place_in_order(named, tensors)

    def _place_by_name(self, named: Sequence[Tuple[str, torch.nn.Parameter]],
                       mapping: Mapping[str, str]) -> List[Tuple[str, Tensor]]:
        w, out, used = self.worker, [], set()
        for n, p in named:
            if n not in mapping:
                raise ValueError(f"mapping: parameter {n} is not mapped to a tensor of the job")
            t = w.tensors.get(mapping[n])
            if t is None:
                raise ValueError(f"mapping: {n} -> {mapping[n]}, which is not a tensor of the job "
                                 f"({', '.join(w.tensors)})")
            if t.count != p.numel():
                raise ValueError(f"{n} {tuple(p.shape)} -> {t.name} {t.shape}: sizes differ")
            used.add(t.name)
            out.append((n, t))
        missing = [t for t in w.tensors if t not in used]
        if missing:
            raise ValueError(f"the job's tensors {missing} have no parameter of the module")
        return out

    def _place_in_order(self, named: Sequence[Tuple[str, torch.nn.Parameter]],
                        tensors: Sequence[Tensor]) -> List[Tuple[str, Tensor]]:
        have = [f"{n} {tuple(p.shape)}" for n, p in named]
        want = [f"{t.name} {t.shape}" for t in tensors]
        if len(named) != len(tensors) or any(tuple(p.shape) != t.shape
                                             for (_, p), t in zip(named, tensors)):
            raise ValueError("the module's parameters do not match the job's tensors in order:\n"
                             f"  module: {', '.join(have)}\n  job:    {', '.join(want)}\n"
                             "(give mapping={parameter: tensor} to place them by name)")
        return [(n, t) for (n, _), t in zip(named, tensors)]

    def describe(self) -> str:
        """Which parameter is which range, one line each."""
        return "\n".join(f"{n} {tuple(p.shape)} -> {t.name} [{t.offset}, {t.offset + t.count})"
                         for (n, t), p in zip(self.placement, self._params))

    # ---- a step ----

    def _reattach(self) -> None:
        """Views a caller replaced (p.data assigned, grads set to None by
        zero_grad(set_to_none=True)) are put back, their values copied in."""
        with torch.no_grad():
            for p, (data, grad) in zip(self._params, self._views):
                if p.data.data_ptr() != data.data_ptr():
                    data.copy_(p.data)
                    p.data = data
                if p.grad is None:
                    grad.zero_()
                    p.grad = grad
                elif p.grad.data_ptr() != grad.data_ptr():
                    grad.copy_(p.grad)
                    p.grad = grad

    def pull(self, *, wait: bool = True) -> None:
        """The servers' parameters into the module, in place (see
        :meth:`psclient.Worker.pull`)."""
        self._reattach()
        self.worker.pull(wait=wait)

    def zero_grad(self) -> None:
        """Zeroes the gradients (the flat vector at once) before backward()."""
        self._reattach()
        self.flat_grad.zero_()

    def push(self, batch_size: Optional[int] = None) -> PushResult:
        """The gradients backward() left in the module to the servers, whose
        optimizer applies them (see :meth:`psclient.Worker.push`)."""
        self._reattach()
        return self.worker.push(batch_size=batch_size)

    def state_vector(self) -> np.ndarray:
        """The flat vector the module's parameters are views of."""
        return self.worker.params
