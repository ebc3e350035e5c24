"""Judge a traced run (tools/tracer.py): did the distributed part do what it must?

    python tools/tracecheck.py TRACE_DIR        # one line per check; exit 1 when one says the run is wrong
    python tools/tracecheck.py TRACE_DIR --expect-restart --quiet   # make elastic-restart: did torchrun restart?

Each check gives a verdict: "ok", "wrong" (the training or its numbers are wrong), or "unknown" (the run did
not show enough, for example a single epoch cannot show whether the order changes between epochs).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # `python tools/tracecheck.py` finds tools/

from tools.tracer import REDUCTIONS  # noqa: E402


@dataclass
class Check:
    name: str
    verdict: str  # ok | wrong | unknown
    message: str

    def __str__(self):
        return f"{self.verdict:7} {self.name:8} {self.message}"


def load(trace_dir) -> dict[int, list[dict]]:
    """The events of the last attempt of the run, per rank (a rank restarted by torchrun: its last process)."""
    processes = []
    for path in sorted(Path(trace_dir).glob("trace-*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        init = next((e for e in events if e["ev"] == "init"), None)
        if init is not None:
            processes.append((init["attempt"], init["t"], init["rank"], events))
    last = max((p[0] for p in processes), default=0)
    ranks: dict[int, list[dict]] = {}
    for attempt, _, rank, events in sorted(processes, key=lambda p: (p[0], p[1])):
        if attempt == last:
            ranks[rank] = _settled(events)
    return ranks


def _settled(events: list[dict]) -> list[dict]:
    """Each loader event with what its pass turned out to be (tools/tracer.py writes it when the pass ends): "train"
    when the loop stepped an optimizer or ran a backward while it handed out batches, else an evaluation when it was
    read to its end; a pass left early without either (a peek at one batch) is dropped: it is no epoch. A pass that
    never ended (the process failed or was killed in it) keeps the tracer's first guess (autograd on or off)."""
    ends = {e["pass_id"]: e for e in events if e["ev"] == "pass_end"}
    settled = []
    for e in events:
        end = ends.get(e.get("pass_id")) if e["ev"] == "loader" else None
        if end is not None:
            if end["kind"] == "peek":
                continue
            e = {**e, "train": end["kind"] == "train", "complete": end["complete"], "fetched": end["fetched"],
                 "first_step_at": end.get("first_step_at")}
            for key in ("indices", "samples"):
                if key in end:
                    e[key] = end[key]
        settled.append(e)
    return settled


def _passes(events, train: bool) -> list[dict]:
    return [e for e in events if e["ev"] == "loader" and e["train"] == train]


def check_shards(ranks) -> Check:
    name = "shards"
    epochs = min((len(_passes(ev, True)) for ev in ranks.values()), default=0)
    if len(ranks) < 2 or not epochs:
        return Check(name, "unknown", "fewer than 2 ranks or no training pass seen")
    for epoch in range(epochs):
        lists = [_passes(ranks[r], True)[epoch] for r in sorted(ranks)]
        if any(p.get("iterable") for p in lists):
            return _iterable_shards(lists, epochs)
        n = lists[0]["dataset_len"]
        total = sum(len(p["indices"]) for p in lists)
        shared = total - len(set().union(*(p["indices"] for p in lists)))
        if shared > len(ranks) - 1:  # more than DistributedSampler's padding
            how = ("every rank iterates a plain sampler: no DistributedSampler" if lists[0]["sampler"] !=
                   "DistributedSampler" else "the DistributedSampler's rank or num_replicas is not each rank's own")
            return Check(name, "wrong", f"epoch {epoch + 1}: the ranks trained on the same samples, {shared} of "
                                        f"{total} indices more than once ({how}; section 02)")
        if n and total >= n and len(set().union(*(p["indices"] for p in lists))) != n:
            return Check(name, "wrong", f"epoch {epoch + 1}: the shards miss samples of the training set")
        world = max((e["world_size"] for r in ranks for e in ranks[r] if e["ev"] == "init"), default=len(ranks))
        cut = {p["settings"]["num_replicas"] for p in lists if p["sampler"] == "DistributedSampler"} - {world}
        if cut:
            return Check(name, "wrong", f"epoch {epoch + 1}: the DistributedSampler cuts the data into "
                                        f"num_replicas={max(cut)} shards for {world} ranks: "
                                        f"{'some shards are never trained on' if max(cut) > world else 'they overlap'}"
                                        f" (num_replicas must be the world size; section 02)")
    return Check(name, "ok", f"{epochs} epoch(s): the ranks' shards are disjoint and cover the training set")


def _iterable_shards(lists, epochs) -> Check:
    """An IterableDataset has no indices: its items are compared across ranks by content (a fingerprint of each)."""
    name = "shards"
    if any(p.get("samples") is None for p in lists):
        return Check(name, "unknown", "an IterableDataset read by DataLoader worker processes: what each rank's "
                                      "loader yields is not seen (num_workers=0 shows it)")
    seen = [set(p["samples"]) for p in lists]
    shared = set.union(*(a & b for i, a in enumerate(seen) for b in seen[i + 1:]))
    items = sum(len(p["samples"]) for p in lists)
    if shared:
        return Check(name, "wrong", f"the ranks' IterableDataset yields the same items: {len(shared)} item(s) on more "
                                    f"than one rank, of {items} read; each rank must yield only its own (for example "
                                    f"items rank, rank + world_size, ... of the stream; section 02)")
    if not all(p.get("complete") for p in lists):
        return Check(name, "unknown", f"an IterableDataset: no item on two ranks among the {items} read, but the "
                                      f"stream did not end within seconds of the batches run, so whole passes "
                                      f"could not be compared")
    return Check(name, "ok", f"{epochs} epoch(s) of an IterableDataset: the ranks' items are disjoint ({items} in a "
                             f"whole pass; whether together they are the whole data set is not known: it has no "
                             f"indices)")


def check_order(ranks) -> Check:
    name = "order"
    for rank, events in sorted(ranks.items()):
        passes = _passes(events, True)
        if len(passes) < 2:
            return Check(name, "unknown", "one epoch run: whether the order changes between epochs cannot be seen")
        orders = [tuple(p["samples"] if p.get("iterable") else p["indices"] or ()) for p in passes]
        if any(p.get("iterable") for p in passes):
            if any(p.get("samples") is None for p in passes):
                return Check(name, "unknown", "an IterableDataset read by worker processes: its order is not seen")
            if len(set(orders)) < len(orders):
                return Check(name, "unknown", f"rank {rank}'s IterableDataset yields the same order every epoch: "
                                              f"whether it should shuffle is its own choice")
            continue
        if len(set(orders)) < len(orders):
            calls = sum(e["ev"] == "set_epoch" for e in events)
            why = "set_epoch is never called" if not calls else f"set_epoch called {calls} time(s), not every epoch"
            return Check(name, "wrong", f"rank {rank} repeats an epoch's order: {why} (section 02)")
    return Check(name, "ok", "every rank sees a new order every epoch")


def _last_digest(events, when="eval"):
    found = [e for e in events if e["ev"] == "digest" and e["when"] == when]
    return found[-1] if found else None


def check_ddp(ranks) -> Check:
    name = "ddp"
    bare = sorted(r for r, ev in ranks.items() if not any(e["ev"] == "ddp" for e in ev))
    digests = {r: next((d for when in ("eval", "destroy", "freed") if (d := _last_digest(ev, when)) and d["params"]),
                       None) for r, ev in ranks.items()}
    params = {r: d["params"] for r, d in digests.items() if d and d["params"]}
    sharded = {r: d["unsharded"] for r, d in digests.items() if d and d.get("unsharded") is not None}
    if sharded and len(sharded) == len(ranks):  # FSDP2: the ranks hold different shards by design
        if max(sharded.values()):
            return Check(name, "wrong", f"{max(sharded.values())} parameter(s) stay plain tensors beside FSDP2's "
                                        f"shards: nothing averages their gradients (fully_shard the root too; "
                                        f"section 07)")
        return Check(name, "ok", "every rank trains an FSDP2 model: every parameter is a shard (DTensor)")
    if bare:
        return Check(name, "wrong", f"rank(s) {bare} train a model that is not wrapped in DDP: no gradient is "
                                    f"averaged (section 02)")
    if len(params) < len(ranks):
        return Check(name, "unknown", "the weights were not seen on every rank (no evaluation, no optimizer)")
    if len(set(params.values())) > 1:
        return Check(name, "wrong", "the ranks end with different weights: the replicas drifted apart")
    return Check(name, "ok", "every rank trains a DDP model and ends with the same weights")


def check_buffers(ranks) -> Check:
    """Judged where the buffers are used: at the first forward of a DDP model's module in eval mode (through the
    wrapper that comes after DDP's pre-forward broadcast of rank 0's buffers). A run that never runs the module in
    eval mode falls back to the buffers when an evaluation loader starts, which can only say they are equal."""
    name = "buffers"
    used = {r: d["buffers"] for r, ev in ranks.items() if (d := _last_digest(ev, "forward"))}
    if used and len(used) < len(ranks):
        return Check(name, "unknown", f"only rank(s) {sorted(used)} evaluate a DDP model with buffers")
    if used:
        if len(set(used.values())) > 1:
            return Check(name, "wrong", "the BatchNorm running statistics differ per rank where the evaluation "
                                        "uses them: broadcast rank 0's buffers first, or use SyncBatchNorm (sections "
                                        "02, 06)")
        return Check(name, "ok", "every rank evaluates with the same BatchNorm statistics")
    buffers = {r: d["buffers"] for r, ev in ranks.items() if (d := _last_digest(ev)) and d["buffers"]}
    if len(buffers) < len(ranks):
        return Check(name, "unknown", "no DDP module with buffers seen at an evaluation on every rank")
    if len(set(buffers.values())) > 1:
        return Check(name, "unknown", "a DDP module's buffers differ per rank, but no rank evaluates with that module")
    return Check(name, "ok", "every rank evaluates with the same BatchNorm statistics")


def check_eval(ranks) -> Check:
    name = "eval"
    passes = {r: _passes(ev, False) for r, ev in ranks.items()}
    count = min((len(p) for p in passes.values()), default=0)
    if not count:
        evaluated = sorted(r for r, p in passes.items() if p)
        if evaluated and len(evaluated) < len(ranks):  # rank 0 alone, say: does it see the whole test set?
            last = [passes[r][-1] for r in evaluated]
            n = last[0]["dataset_len"]
            if not n or any(p.get("indices") is None for p in last):
                return Check(name, "unknown", f"only rank(s) {evaluated} evaluate, over data whose size or items "
                                              f"are not seen")
            union = len(set().union(*(p["indices"] for p in last)))
            if union < n:
                return Check(name, "wrong", f"only rank(s) {evaluated} evaluate, on {union} of the {n} test samples")
            return Check(name, "ok", f"only rank(s) {evaluated} evaluate, on all {n} test samples")
        return Check(name, "unknown", "no evaluation pass seen (a loader read to its end with no optimizer "
                                      "step and no backward)")
    last = [passes[r][count - 1] for r in sorted(passes)]
    n = last[0]["dataset_len"]
    total = sum(len(p["indices"]) for p in last)
    union = len(set().union(*(p["indices"] for p in last)))
    if total > union:
        extra = total - union
        padded = last[0]["sampler"] == "DistributedSampler" and extra < len(last)
        why = ("a DistributedSampler pads the test set to a multiple of the ranks" if padded else
               "the ranks' evaluation parts overlap")
        fixes = ("shard it without padding, Subset(test_set, range(rank, len(test_set), world_size)) per rank; or "
                 "DistributedSampler(..., drop_last=True) and the last len(test_set) % world_size samples evaluated "
                 "on one rank (section 05)" if padded else "give each rank its own part (section 05)")
        return Check(name, "wrong", f"{extra} test sample(s) counted twice, {total} counted for {union}: {why}, which "
                                    f"moves an accuracy or any mean over the test set by up to "
                                    f"{100 * extra / total:.2g} percentage points; {fixes}")
    if n and union < n:
        return Check(name, "wrong", f"{n - union} of {n} test samples never evaluated")
    return Check(name, "ok", f"every one of the {union} test samples is evaluated once")


def check_eval_sum(ranks) -> Check:
    name = "eval_sum"
    if len(ranks) < 2:
        return Check(name, "unknown", "one rank")
    if not any(_passes(ev, False) for ev in ranks.values()):
        return Check(name, "unknown", "no evaluation pass seen")
    for rank, events in sorted(ranks.items()):
        waiting = False
        for e in events:
            if e["ev"] == "loader" and not e["train"]:
                waiting = True
            elif e["ev"] == "coll" and e["op"] in REDUCTIONS:
                waiting = False
            elif waiting and e["ev"] == "loader" and e["train"]:
                break
        if waiting:
            return Check(name, "wrong", f"rank {rank} never combines its evaluation sums with the other ranks' "
                                        f"(all_reduce or reduce them; section 05)")
    return Check(name, "ok", "each evaluation is combined across the ranks (all_reduce, or reduce to the rank "
                             "that reports)")


def check_writer(ranks) -> Check:
    name = "writer"
    writers = defaultdict(set)
    for rank, events in ranks.items():
        for e in events:
            if e["ev"] == "save":
                writers[e["path"]].add(rank)
    shared = {path: sorted(rs) for path, rs in writers.items() if len(rs) > 1}
    if shared:
        path, rs = next(iter(shared.items()))
        return Check(name, "wrong", f"ranks {rs} all wrote {Path(path).name}: save on rank 0 only (section 02)")
    return Check(name, "ok" if writers else "unknown",
                 "one writer per file" if writers else "no torch.save seen")


def check_resume(ranks) -> Check:
    """After a rank loads a checkpoint, its optimizer and its (enabled) GradScaler must start from the states saved in
    it: a state left out of the restore starts afresh (a GradScaler at its first scale, SGD without momentum)."""
    name, restored = "resume", set()
    for rank, events in sorted(ranks.items()):
        saved = None
        for e in events:
            if e["ev"] == "load":
                saved = set(e["state"].values())
            elif e["ev"] == "resumed" and saved is not None:
                if e["digest"] not in saved:
                    return Check(name, "wrong", f"rank {rank} loaded a checkpoint, but its {e['what']} does not start "
                                                f"from any state saved in it: restore it with load_state_dict")
                restored.add(e["what"])
    if not restored:
        loaded = any(e["ev"] == "load" for events in ranks.values() for e in events)
        return Check(name, "unknown", "a checkpoint was loaded, but no optimizer or GradScaler state was seen after "
                                      "it" if loaded else "no checkpoint loaded")
    return Check(name, "ok", f"after loading a checkpoint, every rank's {' and '.join(sorted(restored))} "
                             f"start(s) from the state saved in it")


def check_ran(ranks) -> Check:
    """Every rank of the group runs to the end of the script: none stops on an error or is missing."""
    name = "ran"
    errors = sorted((e["t"], rank, e["lines"][-1].strip()) for rank, events in ranks.items() for e in events
                    if e["ev"] == "error")
    if errors:
        _, rank, line = errors[0]
        return Check(name, "wrong", f"rank {rank} stopped first, on an error: {line}")
    size = max((e["world_size"] for events in ranks.values() for e in events if e["ev"] == "init"), default=0)
    missing = sorted(set(range(size)) - set(ranks))
    if missing:
        return Check(name, "wrong", f"rank(s) {missing} never joined the process group")
    unseen = sorted(rank for rank, events in ranks.items() if not any(e["ev"] == "exit" for e in events))
    if unseen:  # killed, or a forked worker (multiprocessing's) that leaves without Python's exit handlers
        return Check(name, "unknown", f"rank(s) {unseen}: no error seen, and no end either")
    return Check(name, "ok", f"all {size} ranks ran to the end of the script")


CHECKS = (check_shards, check_order, check_ddp, check_buffers, check_eval, check_eval_sum, check_writer)
MORE = (check_resume, check_ran)  # for the mutation check; the doctor says itself whether a run ended and resumed


def judge(trace_dir, checks=CHECKS) -> list[Check]:
    ranks = load(trace_dir)
    if not ranks:
        return [Check("init", "wrong", "no process of the run joined a process group")]
    return [check(ranks) for check in checks]


def attempts(trace_dir) -> set[int]:
    """torchrun's restart counts seen in the run's init events (0: the first attempt)."""
    return {json.loads(line)["attempt"] for path in Path(trace_dir).glob("trace-*.jsonl")
            for line in path.read_text().splitlines() if '"ev": "init"' in line}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--expect-restart", action="store_true", help="fail unless torchrun restarted the group")
    parser.add_argument("--quiet", action="store_true", help="print only what is wrong")
    args = parser.parse_args(argv)
    if args.expect_restart and max(attempts(args.trace_dir), default=0) < 1:
        print("error: no restart happened: the failing rank never reached its batch (lower FAIL_AT)")
        return 1
    results = judge(args.trace_dir)
    for check in results:
        if not args.quiet or check.verdict == "wrong":
            print(check)
    return 1 if any(c.verdict == "wrong" for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
