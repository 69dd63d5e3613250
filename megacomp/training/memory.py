"""Live tensor bytes per category with running peaks: parameters, gradients, optimizer state, activations.

torch has no CPU allocator statistics (and CUDA's count bytes, not what they are for), so
:class:`MemoryTracker` counts storages itself. It is a ``TorchDispatchMode``: every aten op run inside it
(forward, the autograd engine's backward ops and gradient accumulation, optimizer steps, factory functions
such as ``torch.empty``) is seen, and each output whose untyped storage is new is counted with its
``nbytes()`` until the storage is freed (a weak reference callback). Each storage carries one category:

  ``param``  model parameters (tagged by identity with :meth:`tag` before the step);
  ``grad``   parameter gradients: every gradient autograd hands to a parameter (tagged by a tensor hook when it
             is ready, :meth:`watch_params`), each partial contribution to a parameter used twice (tied
             embeddings) from the moment the backward node producing it returns (:meth:`watch_graph`), their
             sums (an ``aten.add`` of two gradients), and buffers the caller tags (an optimizer's flat
             gradient buckets);
  ``optim``  optimizer state (moments, fp32 master copies), tagged by identity by the caller;
  ``act``    storages allocated under ``with tracker.category("act")`` (the forward): activations saved for
             backward and the forward's outputs, freed as backward consumes them;
  ``comm``   storages allocated inside ``with tracker.category("comm")`` (the caller wraps collectives:
             reduce-scatter outputs, all-gather buffers, codec buffers);
  ``temp``   everything else (the default): activation gradients in backward, update temporaries.

A storage's category can change (:meth:`tag`; the gradient rules above), except that ``param`` and ``optim``
are kept. Peaks: ``peak`` is the largest total of live bytes with its split per category at that moment
(``at_peak``), ``cat_peak`` each category's own maximum, ``grad_live_at_peak`` the (label, bytes) of every
gradient alive at the gradient peak, and ``whole_grad_peak`` the peak of gradient bytes leaving out partial
gradients (labelled ``(partial)``: a tied parameter's contributions held by the engine until all arrived). Label
groups (:meth:`track_labels`) add the peak of the storages whose label starts with given prefixes, whatever their
category (``label_peak``, with ``label_live_at_peak``): e.g. an optimizer's own gradient buffers and reduced shards
apart from autograd's gradients. Call :meth:`reset_peak` to start a new measurement window.

Not counted: storages that existed before the tracker started and were never tagged (they are ignored, also
when an op returns a view of them); memory allocated below the dispatcher (scratch space inside a kernel,
gloo/NCCL internal buffers, the C++ codec kernels' own scratch if any, Python objects, the allocator's caching
or rounding: CUDA rounds to 512 bytes, glibc keeps freed pages); ``UntypedStorage.resize_`` called directly
(not an op). Bytes are ``storage.nbytes()``, so a view counts its whole storage once.

Failure behaviour: :meth:`tag` of something that is not a tensor raises TypeError; an unknown category
raises ValueError; tensors without a storage (sparse, nested) are skipped silently.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("param", "grad", "optim", "act", "comm", "temp")
_STICKY = ("param", "optim")
PARTIAL = "(partial)"  # label suffix of a partial gradient held by the autograd engine


class _Entry:
    __slots__ = ("cat", "nbytes", "label", "groups", "__weakref__")

    def __init__(self, cat: str, nbytes: int, label: str) -> None:
        self.cat, self.nbytes, self.label, self.groups = cat, nbytes, label, ()


def _storage(t: torch.Tensor):
    if t.is_sparse or t.device.type == "meta" or getattr(t, "is_nested", False):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (functional wrappers, sparse layouts)
        return None


class MemoryTracker(TorchDispatchMode):
    """See the module docstring. ``device``: count only tensors on this device type ('cpu', 'cuda'); None: all.

        tracker = MemoryTracker()
        with tracker:
            tracker.tag(model.parameters(), "param")
            tracker.watch_params(model)
            with tracker.category("act"):
                loss = model(x)
            tracker.watch_graph(loss, model)
            loss.backward()
        tracker.peak, tracker.at_peak, tracker.cat_peak["grad"]
    """

    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__()
        self.device = device
        self._entries = WeakIdKeyDictionary()  # storage -> _Entry
        self._refs: dict[int, weakref.ref] = {}  # id(entry) -> weakref to its storage (keeps the callback alive)
        self._grads: dict[int, _Entry] = {}  # live gradient entries
        self.current = dict.fromkeys(CATEGORIES, 0)
        self._default = ["temp"]
        self._names: dict[int, str] = {}
        self._finished = False  # a backward node returned and the next has not started: engine bookkeeping
        self._label_groups: dict[str, tuple[str, ...]] = {}  # name -> label prefixes (track_labels)
        self._group_entries: dict[str, dict[int, _Entry]] = {}  # name -> live entries with such a label
        self.reset_peak()

    # -- accounting --------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new window: peaks restart from the bytes alive now."""
        total = sum(self.current.values())
        self.peak, self.at_peak = total, dict(self.current)
        self.cat_peak = dict(self.current)
        self.grad_live_at_peak = self._grad_list()
        self.whole_grad_peak = 0
        self._whole()
        self.label_peak = {g: self._group_bytes(g) for g in self._label_groups}
        self.label_live_at_peak = {g: self._group_list(g) for g in self._label_groups}

    def _grad_list(self) -> list[tuple[str, int]]:
        return sorted(((e.label, e.nbytes) for e in self._grads.values()), key=lambda x: -x[1])

    def _whole(self) -> None:
        whole = sum(e.nbytes for e in self._grads.values() if not e.label.endswith(PARTIAL))
        if whole > self.whole_grad_peak:
            self.whole_grad_peak = whole

    def _changed(self, cat: str) -> None:
        if cat == "grad":
            self._whole()
        if self.current[cat] > self.cat_peak[cat]:
            self.cat_peak[cat] = self.current[cat]
            if cat == "grad":
                self.grad_live_at_peak = self._grad_list()
        total = sum(self.current.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.current)

    def _freed(self, entry: _Entry, _ref) -> None:
        self.current[entry.cat] -= entry.nbytes
        self._grads.pop(id(entry), None)
        self._refs.pop(id(entry), None)
        self._set_groups(entry, ())

    # -- label groups ------------------------------------------------------------------------------
    def track_labels(self, name: str, *prefixes: str) -> None:
        """Keep ``label_peak[name]``: the peak of live bytes of storages whose label starts with one of
        ``prefixes``, in any category (also those labelled before this call), and the (label, bytes) alive then
        (``label_live_at_peak[name]``)."""
        self._label_groups[name] = tuple(prefixes)
        self._group_entries[name] = {}
        for e in list(self._entries.values()):
            self._relabelled(e)
        self.label_peak[name] = self._group_bytes(name)
        self.label_live_at_peak[name] = self._group_list(name)

    def _group_bytes(self, name: str) -> int:
        return sum(e.nbytes for e in self._group_entries[name].values())

    def _group_list(self, name: str) -> list[tuple[str, int]]:
        return sorted(((e.label, e.nbytes) for e in self._group_entries[name].values()), key=lambda x: -x[1])

    def _set_groups(self, entry: _Entry, groups: tuple) -> None:
        for g in entry.groups:
            self._group_entries[g].pop(id(entry), None)
        entry.groups = groups
        for g in groups:
            self._group_entries[g][id(entry)] = entry
        self._group_peaks(groups)

    def _relabelled(self, entry: _Entry) -> None:
        groups = tuple(g for g, pre in self._label_groups.items() if entry.label.startswith(pre)) if entry.label else ()
        if groups != entry.groups:
            self._set_groups(entry, groups)

    def _group_peaks(self, groups) -> None:
        for g in groups:
            n = self._group_bytes(g)
            if n > self.label_peak.get(g, 0):
                self.label_peak[g] = n
                self.label_live_at_peak[g] = self._group_list(g)

    def _account(self, t: torch.Tensor, cat: str, label: str = "", retag: bool = False, inputs=()) -> None:
        if self.device is not None and t.device.type != self.device:
            return
        st = _storage(t)
        if st is None:
            return
        e = self._entries.get(st)
        if e is None:
            if any(st is s for s in inputs):  # a view of a storage that existed before tracking: not ours
                return
            e = _Entry(cat, st.nbytes(), label)
            self._entries[st] = e
            self._refs[id(e)] = weakref.ref(st, lambda r, e=e: self._freed(e, r))
            self.current[cat] += e.nbytes
            if cat == "grad":
                self._grads[id(e)] = e
            self._changed(cat)
            if self._label_groups and label:
                self._relabelled(e)
            return
        n = st.nbytes()
        if n != e.nbytes:  # resized by an out= op or resize_
            self.current[e.cat] += n - e.nbytes
            e.nbytes = n
            self._changed(e.cat)
            self._group_peaks(e.groups)
        if label and (retag or not e.label) and label != e.label:
            e.label = label
            if e.cat == "grad":
                self._whole()
            if self._label_groups:
                self._relabelled(e)
        if retag and e.cat != cat and e.cat not in _STICKY:
            self.current[e.cat] -= e.nbytes
            self._grads.pop(id(e), None)
            e.cat = cat
            self.current[cat] += e.nbytes
            if cat == "grad":
                self._grads[id(e)] = e
            self._changed(cat)

    def category_of(self, t: torch.Tensor) -> Optional[str]:
        """The category ``t``'s storage is counted under, or None when it is not counted."""
        st = _storage(t)
        e = self._entries.get(st) if st is not None else None
        return e.cat if e is not None else None

    def label(self, tensors, label: str) -> None:
        """Give ``tensors`` (one or an iterable) the label ``label`` without changing their category (registering
        storages not seen yet under the current default category)."""
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"MemoryTracker.label takes tensors, got {type(t).__name__}")
            self._account(t, self._default[-1], label, retag=False)
            e = self._entries.get(_storage(t)) if _storage(t) is not None else None
            if e is not None and e.label != label:
                e.label = label
                if self._label_groups:
                    self._relabelled(e)

    def tag(self, tensors, category: str, label: str = "") -> None:
        """Count ``tensors`` (one tensor or an iterable) under ``category`` from now on (registering storages
        not seen yet, e.g. created before the tracker). ``param`` and ``optim`` storages keep their category."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; one of {CATEGORIES}")
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"MemoryTracker.tag takes tensors, got {type(t).__name__}")
            self._account(t, category, label, retag=True)

    @contextlib.contextmanager
    def category(self, name: str):
        """Storages allocated inside count under ``name`` (until retagged)."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown memory category {name!r}; one of {CATEGORIES}")
        self._default.append(name)
        try:
            yield
        finally:
            self._default.pop()

    # -- the dispatch hook -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        in_storages = [s for s in (_storage(a) for a in ins) if s is not None]
        cat, reused = self._default[-1], None
        if (func is torch.ops.aten.add.Tensor and self._finished and len(ins) == 2
                and ins[0].shape == ins[1].shape):
            # the engine summing a node's output into a gradient buffer that already holds one (a tensor used
            # twice). Under any dispatch mode autograd does this out of place (isTensorSubclassLike is true);
            # without one it adds in place into the buffer it holds: count the sum as taking over that storage.
            st = _storage(ins[0])
            reused = self._entries.get(st) if st is not None else None
            if reused is not None:
                cat = reused.cat
        if reused is not None:  # released first: the sum lands in its bytes (its finalizer then subtracts 0)
            self.current[reused.cat] -= reused.nbytes
            self._grads.pop(id(reused), None)
            reused.nbytes = 0
            self._set_groups(reused, ())
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._account(t, cat, reused.label if reused is not None else "", inputs=in_storages)
        return out

    # -- gradients ---------------------------------------------------------------------------------
    def watch_params(self, model: torch.nn.Module) -> list:
        """Tag every trainable parameter's storage ``param`` and each gradient autograd produces for it ``grad``
        (labelled with the parameter's name) when it is ready, before any accumulate-grad hook runs. Returns
        the hook handles."""
        handles = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            self.tag(p, "param", name)
            self._names[id(p)] = name
            handles.append(p.register_hook(lambda g, name=name: self._account(g, "grad", name, retag=True)))
        return handles

    def watch_graph(self, output: torch.Tensor, model: torch.nn.Module) -> int:
        """Register hooks on every backward node of ``output``'s graph (call after the forward, before backward;
        they live as long as the graph): each partial gradient a node sends to one of ``model``'s parameters is
        tagged ``grad`` as soon as the node returns (a parameter used twice, such as a tied embedding, gets two,
        held by the engine until both arrived), and the engine's sums of two contributions are counted as
        done in place (see ``__torch_dispatch__``). Returns the number of nodes hooked."""
        ids = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        seen, stack = set(), [output.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            feeds = []
            for i, (nxt, _) in enumerate(node.next_functions):
                var = getattr(nxt, "variable", None)  # AccumulateGrad nodes carry their leaf
                if var is not None and id(var) in ids:
                    feeds.append((i, ids[id(var)]))
                    if nxt not in seen:
                        seen.add(nxt)
                        nxt.register_prehook(self._node_start)
                elif nxt is not None:
                    stack.append(nxt)
            node.register_prehook(self._node_start)
            node.register_hook(self._node_hook(tuple(feeds)))
        return len(seen)

    def _node_start(self, grad_outputs) -> None:
        self._finished = False

    def _node_hook(self, feeds):
        def hook(grad_inputs, grad_outputs):  # returns None: the gradients pass on unchanged
            self._finished = True
            for i, name in feeds:
                if isinstance(grad_inputs[i], torch.Tensor):
                    self._account(grad_inputs[i], "grad", f"{name} {PARTIAL}", retag=True)
        return hook

    # -- reports -------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Plain numbers (bytes): peak total and its split, each category's own peak, the live gradients at the
        gradient peak, the peak of whole gradients (partials the engine holds left out), the label groups' peaks
        and what was alive at each, and the bytes alive now."""
        return {"peak": self.peak, "at_peak": dict(self.at_peak), "cat_peak": dict(self.cat_peak),
                "whole_grad_peak": self.whole_grad_peak, "label_peak": dict(self.label_peak),
                "label_live_at_peak": {g: [list(x) for x in v] for g, v in self.label_live_at_peak.items()},
                "grad_live_at_peak": [list(x) for x in self.grad_live_at_peak], "current": dict(self.current)}


def rss() -> dict:
    """This process's resident set (VmRSS) and its high-water mark (VmHWM) in bytes from /proc/self/status
    ({} where there is no /proc), plus ru_maxrss (bytes, Linux reports KiB) which cannot be reset."""
    import resource

    out = {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs). False where unsupported."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False
