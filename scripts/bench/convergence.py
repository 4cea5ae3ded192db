"""How far training strays from the failure-free run after a failure, per recovery policy.

Every arm trains the same GPT (dropout 0.1) on the demo's real text through ``elaswave-run`` with
``--elastic``; the failure arms lose rank ``--fail-rank`` to a SIGKILL it sends itself in
iteration ``--fail-at``:

* ``elaswave``: the default policy and the layout-invariant RNG;
* ``megatron_rng``: the same recovery with Megatron's per-stage dropout streams
  (``--elastic-rng megatron``), compared with a failure-free run that uses them too;
* ``drop_replica`` (TorchFT-style: the damaged replica's micro-batches are dropped) and
  ``reroute`` (ReCycle-style at replica granularity: they go to the other replicas).

The deviation of an arm is the relative ``lm_loss`` difference to its failure-free reference,
``|loss - reference| / reference``, averaged (and maximised) over the iterations after the
failure. ``--json`` prints one object with the loss curves.

    python scripts/bench/convergence.py --train-iters 220 --fail-at 20
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import demo_corpus, pretrain_records

ARMS = {
    "elaswave": ("reference", []),
    "megatron_rng": ("megatron_reference", ["--elastic-rng", "megatron"]),
    "drop_replica": ("reference", ["--elastic-policy", "drop-replica"]),
    "reroute": ("reference", ["--elastic-policy", "reroute"]),
}
"""Failure arm: (its failure-free reference, flags)."""
REFERENCES = {"reference": [], "megatron_reference": ["--elastic-rng", "megatron"]}


def model_flags(args: argparse.Namespace, data: str) -> list[str]:
    return [
        "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
        "--num-layers", "8", "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(args.train_iters), "--lr", "2e-3",
        "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--seed", "1234",
        "--data-path", data, "--split", "90,10,0", "--log-interval", "1000",
        "--eval-interval", "100000", "--elastic", "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights",
    ]


def deviation(arm: list[dict], reference: list[dict], after: int) -> dict:
    pairs = [(a["lm_loss"], r["lm_loss"]) for a, r in zip(arm, reference, strict=True)
             if a["iteration"] > after]
    relative = [abs(a - r) / abs(r) for a, r in pairs]
    return {"mean_rel_dev": statistics.fmean(relative), "max_rel_dev": max(relative)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--train-iters", type=int, default=220)
    parser.add_argument("--fail-at", type=int, default=20, help="iteration in which the rank dies")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of the arms")
    parser.add_argument("--workdir", default="runs/bench-convergence")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arms = [name for name in args.arms.split(",") if name]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    if not 1 <= args.fail_at < args.train_iters:
        parser.error("--fail-at must lie within --train-iters")
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    base = model_flags(args, demo_corpus(Path(args.workdir)))
    failure = ["--elastic-inject-failure", f"rank={args.fail_rank},iteration={args.fail_at}"]

    curves: dict[str, list[dict]] = {}
    for name in sorted({ARMS[arm][0] for arm in arms}):
        say(f"  {name}: failure-free, {args.train_iters} iterations")
        curves[name] = pretrain_records([*base, *REFERENCES[name]], args.nproc)
    results = {}
    for arm in arms:
        reference, flags = ARMS[arm]
        say(f"  {arm}: rank {args.fail_rank} killed in iteration {args.fail_at}")
        curves[arm] = pretrain_records([*base, *flags, *failure], args.nproc)
        results[arm] = {**deviation(curves[arm], curves[reference], args.fail_at),
                        "reference": reference,
                        "global_batch_after": curves[arm][-1]["global_batch_size"],
                        "same_samples": all(a["samples_digest"] == r["samples_digest"]
                                            for a, r in zip(curves[arm], curves[reference]))}
        say(f"    mean relative deviation {results[arm]['mean_rel_dev']:.2e}, "
            f"max {results[arm]['max_rel_dev']:.2e}")
    summary = {
        "layout": f"TP{args.tp}xPP{args.pp}xDP{args.nproc // (args.tp * args.pp)}",
        "train_iters": args.train_iters, "fail_at": args.fail_at, "fail_rank": args.fail_rank,
        "arms": results,
        "losses": {name: [r["lm_loss"] for r in records] for name, records in curves.items()},
    }
    if "elaswave" in results and "megatron_rng" in results:
        summary["deviation_reduction_vs_megatron_rng"] = (
            1 - results["elaswave"]["mean_rel_dev"] / results["megatron_rng"]["mean_rel_dev"])
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['layout']}, rank {args.fail_rank} killed in iteration {args.fail_at} of "
          f"{args.train_iters}; mean / max relative lm-loss deviation after the failure:")
    for arm, result in results.items():
        print(f"  {arm:13s} {result['mean_rel_dev']:.2e} / {result['max_rel_dev']:.2e}  "
              f"(global batch {result['global_batch_after']}, same samples {result['same_samples']})")
    if "deviation_reduction_vs_megatron_rng" in summary:
        print(f"ElasWave's deviation is {summary['deviation_reduction_vs_megatron_rng']:.1%} lower "
              "than with Megatron's RNG")


if __name__ == "__main__":
    main()
