"""Host synchronisations on the compressed path, measured: every one, with its Python stack.

What runs, per configuration (one process per rank, tensors on ``--device``):
  * a Channel with int8 and error feedback (validation off, as the trainer runs after its first iteration):
    ``all_reduce`` (async, then wait), ``reduce_scatter_tensor``, ``all_gather_into_tensor``;
  * a DistributedOptimizer step (int8 gradients with error feedback, int8 parameters, clipping): the backward that
    launches the buckets' reduce-scatters and ``step()``; ZeRO-1, and ZeRO-2 with the codec side stream
    (megacomp.comm.codec_stream).
Each is first run twice untimed (Triton compiles, first-call validation, buffers), then once under
``torch.cuda.set_sync_debug_mode("warn")``: torch warns at every synchronising call (``.item()``, a blocking copy,
a stream or device synchronise), and each warning is recorded with the stack of the Python call that caused it.
A sync whose innermost megacomp frame lies in a function with a ``# host sync:`` justification
(tests/test_host_sync_audit.py lists them) is "justified"; any other is "unexpected". Then, with ``--strict``,
the one-rank NCCL configuration runs the same calls once more under ``set_sync_debug_mode("error")``.

Configurations: world size 1 on NCCL (the codec is skipped by design for one rank: the collectives reduce to
torch's, the ZeRO step still runs its clipping and overflow check), and ``--ranks`` gloo ranks sharing the GPU (the
codec path). Syncs inside torch's gloo backend (its worker thread stages CUDA tensors through host memory) happen
outside Python and are not megacomp's; NCCL has none. With ``--device cpu`` the same calls run on CPU tensors over
gloo (no device to synchronise with: 0 syncs); that proves the script and its report, not the GPU.

Verdict: PASS when no unexpected sync occurred and the ZeRO step has at most one justified one (its overflow
decision). Writes ``sync_check.md`` and ``sync_check.json`` to ``--out``; exit status 1 on FAIL.

Run:  python -m benchmarks.sync_check --out /tmp/sync [--device cuda] [--ranks 2] [--numel 1M] [--strict]
      [--worlds 1,ranks]   (the CPU dry run of scripts/device_checks.sh runs only the multi-rank configuration)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import traceback
import warnings
from datetime import timedelta

import torch
from benchmarks.spawn_ranks import spawn_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARK = "# host sync:"


def _parse_count(s: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20}.get(s[-1].lower(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _justified(frames) -> tuple[bool, str]:
    """(whether the innermost megacomp frame's function carries a ``# host sync:`` comment, that frame)."""
    import ast

    for fr in reversed(frames):
        path = pathlib.Path(fr.filename)
        if "megacomp" not in path.parts or "benchmarks" in path.parts:
            continue
        try:
            text = path.read_text()
        except OSError:
            return False, f"{fr.filename}:{fr.lineno}"
        lines = text.splitlines()
        funcs = sorted(((n.lineno, n.end_lineno) for n in ast.walk(ast.parse(text))
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= fr.lineno <= n.end_lineno),
                       key=lambda t: t[1] - t[0])
        start = funcs[0][0] if funcs else 1
        return any(MARK in ln for ln in lines[start - 1:fr.lineno]), f"{path.relative_to(ROOT) if ROOT in path.parents else path}:{fr.lineno} in {fr.name}"
    return False, "no megacomp frame"


class SyncRecorder:
    """Inside ``with``: torch's sync debug mode ``mode`` ("warn" records; "error" raises at the first sync), every
    sync warning kept as (justified, where, stack). No-op off CUDA."""

    def __init__(self, cuda: bool, mode: str = "warn") -> None:
        self.cuda, self.mode, self.syncs = cuda, mode, []

    def __enter__(self):
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def _show(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text:
            return
        frames = traceback.extract_stack()[:-1]
        ok, where = _justified(frames)
        self.syncs.append({"justified": ok, "where": where, "message": text.splitlines()[0],
                           "stack": "".join(traceback.format_list(frames[-12:]))})

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        self._cm.__exit__(*exc)
        return False


def _collectives(dev, numel, world):
    from megacomp.comm import Channel, CommOptions

    ch = Channel("sync_check", "int8", error_feedback="ef", options=CommOptions(validate=False, duplex=None))
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(numel, device=dev, generator=gen)
    shard = torch.empty(numel // world, device=dev)
    gathered = torch.empty(numel, device=dev)

    def all_reduce():
        t = x.clone()
        work = ch.all_reduce(t, async_op=True, key="ar")
        if work is not None:
            work.wait()

    return {"all_reduce (async, EF)": all_reduce,
            "reduce_scatter (EF)": lambda: ch.reduce_scatter_tensor(shard, x, key="rs"),
            "all_gather": lambda: ch.all_gather_into_tensor(gathered, x[:numel // world])}


def _zero_step(dev, stage, stream):
    from torch import nn

    from megacomp.optimizer import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(dev)
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec="int8", param_codec="int8",
                               error_feedback="ef", min_compress_numel=0, bucket_size=1 << 18, max_grad_norm=1.0,
                               zero_stage=stage, codec_stream=stream, lr=1e-4)
    x = torch.randn(8, 512, device=dev)

    def step():
        model(x).square().mean().backward()
        opt.step()
    return step


def rank_main(rank, world, init_file, args, q):
    try:
        cuda = args.device == "cuda"
        backend = "nccl" if (cuda and world == 1) else "gloo"
        if cuda:
            torch.cuda.set_device(0)
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        cases = dict(_collectives(dev, args.numel, world))
        cases["ZeRO-1 backward + step"] = _zero_step(dev, 1, False)
        cases["ZeRO-2 backward + step, codec side stream"] = _zero_step(dev, 2, True)
        rows = []
        for name, fn in cases.items():
            for _ in range(2):
                fn()
            with SyncRecorder(cuda) as rec:
                fn()
            strict = None
            if args.strict and cuda and backend == "nccl":
                try:
                    with SyncRecorder(cuda, "error"):
                        fn()
                    strict = "passed"
                except RuntimeError as e:
                    strict = f"raised: {str(e).splitlines()[0]}"
            rows.append({"case": name, "syncs": rec.syncs, "strict": strict})
        dist.destroy_process_group()
        q.put((rank, True, {"backend": backend, "world": world, "rows": rows}))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def launch(world, args):
    """``world`` spawned ranks (benchmarks.spawn_ranks): [(rank, its result)]."""
    return list(enumerate(spawn_ranks(rank_main, world, (args,), timeout=args.timeout, prefix="sync-check-")))


def verdict(results) -> tuple[bool, list[str]]:
    """(pass, reasons): no unexpected sync anywhere; at most one justified sync in a ZeRO step; strict runs passed."""
    reasons = []
    for res in results:
        for rank, r in res:
            for row in r["rows"]:
                unexpected = [s for s in row["syncs"] if not s["justified"]]
                if unexpected:
                    reasons.append(f"{r['backend']} world {r['world']} rank {rank}, {row['case']}: {len(unexpected)} "
                                   f"unexpected sync(s), first at {unexpected[0]['where']}")
                if row["case"].startswith("ZeRO") and len(row["syncs"]) > 1:
                    reasons.append(f"{r['backend']} world {r['world']} rank {rank}, {row['case']}: {len(row['syncs'])} "
                                   f"syncs (at most the overflow decision's one)")
                elif not row["case"].startswith("ZeRO") and row["syncs"]:
                    reasons.append(f"{r['backend']} world {r['world']} rank {rank}, {row['case']}: a sync inside a "
                                   f"compressed collective")
                if row["strict"] not in (None, "passed") and not row["case"].startswith("ZeRO"):
                    reasons.append(f"strict (error mode) {row['case']}: {row['strict']}")
    return not reasons, reasons


def report(results, args, device_name: str) -> str:
    ok, reasons = verdict(results)
    lines = [f"# Host synchronisations on the compressed path: {device_name}", "",
             f"Command: `python -m benchmarks.sync_check --device {args.device} --ranks {args.ranks} --numel "
             f"{args.numel}{' --strict' if args.strict else ''}`", "",
             "| backend | world | rank | case | syncs | justified | unexpected | where | strict (error mode) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for rank, r in res:
            for row in r["rows"]:
                js = sum(s["justified"] for s in row["syncs"])
                where = "; ".join(sorted({s["where"] for s in row["syncs"]})) or "-"
                lines.append(f"| {r['backend']} | {r['world']} | {rank} | {row['case']} | {len(row['syncs'])} | {js} | "
                             f"{len(row['syncs']) - js} | {where} | {row['strict'] or '-'} |")
    lines += ["", f"**Verdict: {'PASS' if ok else 'FAIL'}**"] + [f"- {r}" for r in reasons]
    stacks = [(r["backend"], r["world"], rank, row["case"], s) for res in results for rank, r in res
              for row in r["rows"] for s in row["syncs"]]
    if stacks:
        lines += ["", "## Stacks", ""]
        for backend, world, rank, case, s in stacks:
            lines += [f"### {backend} world {world} rank {rank}, {case}: {'justified' if s['justified'] else 'UNEXPECTED'}"
                      f" at {s['where']}", "", "```", s["stack"].rstrip(), "```", ""]
    if args.device == "cpu":
        lines += ["", "CPU run: no device to synchronise with, so no syncs can appear; it checks this script only."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks sharing the device for the multi-rank case")
    p.add_argument("--numel", type=_parse_count, default=_parse_count("1M"))
    p.add_argument("--worlds", default="1,ranks", help="which configurations: 1 (one rank), ranks (--ranks gloo "
                   "ranks), comma separated")
    p.add_argument("--strict", action="store_true", help="also run the NCCL world-1 calls under sync debug 'error'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sync_check: skipped, no CUDA GPU (torch.cuda.is_available() is False); use --device cpu for a dry run")
        return 2
    if args.ranks < 2 or args.numel % (args.ranks * 2):
        raise SystemExit(f"sync_check: --ranks must be >= 2 and --numel a multiple of 2 x ranks, got {args.ranks} "
                         f"and {args.numel}")
    worlds = [w.strip() for w in args.worlds.split(",") if w.strip()]
    if not worlds or any(w not in ("1", "ranks") for w in worlds):
        raise SystemExit(f"sync_check: --worlds takes 1 and/or ranks, got {args.worlds!r}")
    results = [launch(1 if w == "1" else args.ranks, args) for w in worlds]
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_check.json").write_text(json.dumps({"device": name, "results": results}, indent=1))
    text = report(results, args, name)
    (out / "sync_check.md").write_text(text)
    ok, _ = verdict(results)
    print(text.split("## Stacks")[0])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
