"""Describe a sequence-length distribution: a published profile, a lengths file, or a corpus.

    lengthwise workload --profile lmsys --samples 100000
    lengthwise workload --profile chunkflow-eval --samples 100000 --json
    lengthwise workload --profile chatqa2 --context-length 32768 --overlong drop --plot chatqa2.png
    lengthwise workload --data stdlib                  # Python's own sources, byte tokens (CPU)
    lengthwise workload --lengths lengths.txt --context-length 8192 --overlong truncate

Prints count, mean, percentiles and, under 1K/4K/8K/32K/128K tokens, the share of sequences,
of tokens (memory, linear FLOPs) and of attention FLOPs (~ sum of L^2). On the papers'
long-tail sets these disagree wildly: `--profile chunkflow-eval --samples 100000` (seed 0) puts
98.2% of sequences, 67.9% of tokens but only 1.3% of attention work under 1K; the 0.08% of
sequences over 32K carry 95% of the attention.
`--json` keys: count, mean, percentiles, share_below, token_share_below,
attention_share_below (each mapping "1024".."131072" to a fraction), source.

Where the profiles come from (workloads/profiles.py; each docstring lists its knots): lmsys,
chunkflow-eval, lmsys-skrull, wikipedia and chatqa2 use the shares their papers' tables publish
(under 1K..128K and the longest), with the shortest length and a median ASSUMED. github is
PARTLY ASSUMED: infinipipe §1 publishes 91.5% under 8K and a >64K tail of 0.6% holding 21.6% of
tokens; the rest is chosen to match those. commoncrawl is ENTIRELY ASSUMED: no paper's text
gives its shares (the histograms are figures only), so its knots are a guess shaped by
hydraulis Fig. 14 and slimpack §2.1.1. tiny is assumed (CPU-sized). For measured lengths use
`--data` on a corpus or `--lengths` on a file of token counts.
"""

from __future__ import annotations

import argparse
import sys

from lengthwise.files import json_text
from lengthwise.commands.common import add_workload_args, lengths_source_from_args
from lengthwise.limits import SAMPLES, check_size
from lengthwise.paths import check_writable
from lengthwise.files import write_atomic
from lengthwise.workloads.lengths import THRESHOLDS, length_stats
from lengthwise.workloads.plot import histogram_png


def register(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--samples", metavar="N", type=int,
                        help="draws from a profile (default 100000); for a file or corpus, "
                             "a random subset of N (default: all)")
    parser.add_argument("--json", action="store_true", help="print the statistics as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="write a histogram of lengths (log-x) to this PNG")


def run(args: argparse.Namespace) -> int:
    check_size("--samples", args.samples, SAMPLES)
    if args.plot:
        check_writable(args.plot, "--plot")
    source = lengths_source_from_args(args)
    lengths = source.describe_lengths(args.samples, args.seed)
    stats = length_stats(lengths) | {"source": source.name,
                                     "overlong": {"policy": source.overlong, "count": source.overlong_count}}
    print(json_text(stats, indent=2) if args.json else format_table(stats))
    note = source.overlong_note()
    if note and not args.json:
        print(note, file=sys.stderr)
    if args.plot:
        write_atomic(args.plot, histogram_png(lengths, title=source.name))
    return 0


def format_table(stats: dict) -> str:
    p = stats["percentiles"]
    lines = [f"{stats['source']}: {stats['count']:,} sequences, mean {stats['mean']:,.1f} tokens",
             f"  p50 {p['p50']:,.0f}  p90 {p['p90']:,.0f}  p99 {p['p99']:,.0f}  "
             f"max {p['max']:,}  (min {p['min']:,})",
             f"  {'shorter than':>12}  {'sequences':>9}  {'tokens':>8}  {'attention':>9}"]
    for t in map(str, THRESHOLDS):
        lines.append(f"  {int(t) // 1024:>11}K  {stats['share_below'][t]:>9.3%}  "
                     f"{stats['token_share_below'][t]:>8.3%}  "
                     f"{stats['attention_share_below'][t]:>9.3%}")
    return "\n".join(lines)
